"""One test session per tested torch release, plus a type check (CI runs them all)."""

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False

# 2.13.0 is the local CPU build; 2.11.0 is the newest release where the
# pipelining and DTensor hazards are native; 2.14.1 moved DTensor strategies
# into single-dim tables. The last two are CUDA builds that run on CPU.
TORCH_VERSIONS = ["2.13.0", "2.11.0", "2.14.1"]


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    # The README's two set-up commands, with this session's torch.
    session.install(f"torch=={torch}", ".")
    session.run("gradsafe", "doctor")
    session.install(f"torch=={torch}", ".[test]")
    session.run("pytest", "-q", *session.posargs, success_codes=[0, 5])


@nox.session
def typing(session: nox.Session) -> None:
    session.install("torch==2.13.0", ".", "mypy")
    session.run("mypy", "--ignore-missing-imports", "-p", "gradsafe")
