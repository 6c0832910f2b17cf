"""``gradsafe.patch("dtensor")`` under no_grad, inference_mode and ``torch.device("meta")``.

The plan (the propagator probe) runs once per process, when the patch is
first applied, in whatever context the caller is in; it must give the same
answer as in a plain context. Each context is tried in a fresh process, so
that it really is the first plan there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gradsafe.dtensor import probe_propagator

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke

_CONTEXTS = {
    "plain": "contextlib.nullcontext()",
    "no_grad": "torch.no_grad()",
    "inference_mode": "torch.inference_mode()",
    "meta_device": 'torch.device("meta")',
}

_SCRIPT = """
import contextlib, json, sys
import torch
import gradsafe
from gradsafe.dtensor._patch import plan
from gradsafe.patching import Skip
with {context}:
    handle = gradsafe.patch("dtensor")
    planned = plan()  # what patch() just planned (once per process)
    print(json.dumps({{
        "names": list(handle.names),
        "skipped": planned.reason if isinstance(planned, Skip) else None,
        "targets": [] if isinstance(planned, Skip) else [t.where for t in planned],
    }}))
gradsafe.unpatch("dtensor")
"""


def _first_patch_in(context: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(context=_CONTEXTS[context])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if done.returncode != 0:
        pytest.fail(f"patch() under {context} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def plain() -> dict[str, object]:
    return _first_patch_in("plain")


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "meta_device"])
def test_first_patch_in_context_plans_as_in_a_plain_one(plain, context: str) -> None:
    assert _first_patch_in(context) == plain


def test_plain_plan_matches_the_installed_torch(plain) -> None:
    if probe_propagator().keeps_placements:
        assert plain["names"] == []
        assert str(plain["skipped"]).startswith("verified: upstream already keeps placements")
    else:
        assert plain["names"] == ["dtensor"]
        assert plain["skipped"] is None
        assert any("op_strategy_funcs" in str(t) for t in plain["targets"])  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "context",
    [torch.no_grad, torch.inference_mode, lambda: torch.device("meta")],
    ids=["no_grad", "inference_mode", "meta_device"],
)
def test_probe_is_context_independent(context) -> None:  # type: ignore[no-untyped-def]
    reference = probe_propagator()
    with context():
        found = probe_propagator()
    assert found == reference
