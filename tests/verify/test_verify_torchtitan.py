"""``gradsafe verify --torchtitan MODEL[:CONFIG] --schedule NAME``: torchtitan's model, split as its pipeline splits it.

Optional: skipped unless torchtitan is installed (the ``torchtitan`` test extra; torchtitan 0.3.0
needs torch >= 2.14). Runs the command in a fresh process: torchtitan fixes its device type at
import, so it must be imported through gradsafe's CPU probes, before anything else imports it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from _ranks import worker_env

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("optional: the torchtitan test extra is not installed", allow_module_level=True)

TIMEOUT = 300


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsafe", "verify", *args],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_llama3_debugmodel_under_zbv_is_exact_with_gradsafe_where_torchs_split_crashes() -> None:
    done = _verify(
        "--torchtitan", "llama3", "--schedule", "ZBVZeroBubble", "--orders", "w-reversed", "--json"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["stages"] == 4
    assert report["gradsafe"]["w-reversed"]["verdict"] == "exact"
    # torchtitan's default selective AC: torch's W re-runs a region its B already consumed.
    upstream = report["upstream"]["w-reversed"]
    assert upstream["verdict"] == "crash" and "backward an extra time" in upstream["message"]
    # ZBV on 2 ranks: 4 stages as torchtitan's split makes them: the embedding, one
    # checkpointed block each, then the final norm and the head.
    parts: dict[str, set[str]] = {}
    for row in report["grads"]:
        stage, _, fqn = row["name"].partition(".")
        if stage.isdigit():  # a parameter; "stage s input i" rows are the inputs
            parts.setdefault(stage, set()).add(fqn.split(".")[0])
    assert parts == {
        "0": {"tok_embeddings"},
        "1": {"layers"},
        "2": {"layers"},
        "3": {"norm", "lm_head"},
    }
    layers = {row["name"].split(".")[3] for row in report["grads"] if ".layers." in row["name"]}
    assert layers == {"_checkpoint_wrapped_module"}, layers
    recomputed = [h for h in report["hooks"] if h["label"].endswith("recomputed in backward")]
    assert recomputed and all(h["fused"] == 4 for h in recomputed)
    assert all(h["calls"]["gradsafe"]["w-reversed"] == h["fused"] for h in report["hooks"]), report[
        "hooks"
    ]


def test_an_unknown_config_exits_2_naming_the_debug_configs() -> None:
    done = _verify("--torchtitan", "llama3:llama3_nonesuch", "--schedule", "ZBVZeroBubble")
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "llama3_nonesuch" in done.stderr and "llama3_debugmodel" in done.stderr


def test_torchtitan_without_a_schedule_exits_2() -> None:
    done = _verify("--torchtitan", "llama3")
    assert done.returncode == 2 and "--schedule" in done.stderr
