"""How every launcher ends on a user's mistake (the message once, by rank 0, without a traceback, exit status 2) and
on a serving engine's failure (the message by the rank that saw it, exit status 3).

    @hydra_main(config_path=..., config_name=...)   # hydra.main, version_base 1.3, with user errors reported
    def main(raw) -> None: ...

A user error is one of `USER_ERRORS`: a bad option or config (Hydra's composition errors, OmegaConf's
missing or ill-typed values, our ConfigErrors), a missing file, a target that cannot be reached or is not
the one a prep or an export was made for, a prep directory or shard set that is unusable, an export that is
broken (non-finite weights) or foreign, a bad prompts file. Its message names the file, the option or the
target and the remedy, so a traceback adds nothing; under torchrun every rank meets it, and only rank 0
prints it (each rank still exits with `USER_ERROR`, which torchrun's failure report lists per rank; torchrun
itself then exits 1). A `SystemExit` with a message (a launcher's own deliberate stop) is reported the same way.

An engine error is one of `ENGINE_ERRORS`: a vLLM server that exited, refused a request, went silent, sent a torn
answer or wrote a file that is not the one asked for. It happens to one rank (its own server, its own requests),
so the rank that saw it prints it, once, naming the rank and its host; the message names the server's URL and log
and quotes vLLM's root cause. Exit status `ENGINE_ERROR`: neither the user's mistake nor a bug of ours.

Anything else is a bug and keeps its traceback (exit status 1).

Python warnings are shown by rank 0 only, each text once: every rank computes the same ones, and one copy per
rank buries them. `HYDRA_FULL_ERROR=1` (Hydra's own switch) keeps the full traceback of user errors too.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

USER_ERROR = 2  # the exit status of a known user error (argparse uses 2 for usage errors too)
ENGINE_ERROR = 3  # the exit status of a serving engine's failure

# "module:Class"; looked up in sys.modules only: an exception of a class whose module was never imported cannot
# have been raised, so checking costs no import (and launch/ stays free of the packages' import order).
USER_ERRORS = (
    "infra.config_keys:ConfigError",  # prep, training and the plan raise it
    "data_prep.targets:TargetUnavailable",
    "data_prep.targets:UnknownTarget",
    "data_prep.targets:PresetMismatch",  # a preset's geometry is not its config.json's
    "data_prep.shards:ShardError",
    "infra.dirlock:DirLocked",  # another process holds the run or prep directory
    "data_prep.fidelity:FidelityError",
    "data_prep.regenerate:RegenerationError",  # the regeneration server cannot be used at all (URL, error)
    "serving.server:VLLMUnavailable",  # vllm.python missing, without vLLM, or too old
    "train.online:TargetMismatch",
    "train.plan:PlanError",
    "models.export:ExportError",
    "eval.prompts:PromptsError",
    "hydra.errors:CompactHydraException",  # a bad override, an unknown config group or key
    "omegaconf.errors:OmegaConfBaseException",  # a missing (???) or ill-typed value
    "builtins:FileNotFoundError",
)
ENGINE_ERRORS = (
    # a vLLM server that exited, refused a request or its settings, went silent or sent a torn answer: its URL, log
    # and vLLM's reason
    "serving.server:VLLMServerError",
    "serving.states:VLLMCaptureError",  # a server's file is not its sample's (other layers, another dtype)
)
# What a message starts with, by the class it is an instance of (first match), so the kind of mistake shows.
PREFIXES = (("ConfigError", "config error"), ("CompactHydraException", "config error"),
            ("OmegaConfBaseException", "config error"))

F = TypeVar("F", bound=Callable[..., Any])


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def user_error_classes(refs: tuple[str, ...] = USER_ERRORS) -> tuple[type[BaseException], ...]:
    found = []
    for ref in refs:
        module, _, name = ref.partition(":")
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def describe(err: BaseException) -> str:
    """The message printed for a user error: its kind, its text, and what Hydra names as its cause."""
    kinds = {c.__name__ for c in type(err).__mro__}
    prefix = next((p for name, p in PREFIXES if name in kinds), "error")
    text = str(err).strip() or type(err).__name__
    cause = err.__cause__
    if cause is not None and "CompactHydraException" in kinds and str(cause) not in text:
        text += f"\n{cause}"  # Hydra puts the offending key's message in the cause, as its own report shows it
    return f"{prefix}: {text}"


def user_errors(main: F, full: bool = False) -> F:
    """`main` with user errors reported once (see the module docstring); `full`: let them through as they are."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except SystemExit as e:  # a deliberate stop with a message (`raise SystemExit("config error: ...")`)
            if full or not isinstance(e.code, str):
                raise
            if rank() == 0:
                print(e.code, file=sys.stderr, flush=True)
            raise SystemExit(USER_ERROR) from None
        except Exception as e:
            if full:
                raise
            if isinstance(e, user_error_classes(ENGINE_ERRORS)):
                import socket

                print(f"engine error on rank {rank()} of {os.environ.get('WORLD_SIZE', '1')} ({socket.gethostname()}): "
                      f"{str(e).strip()}", file=sys.stderr, flush=True)
                raise SystemExit(ENGINE_ERROR) from None
            if not isinstance(e, user_error_classes()):
                raise
            if rank() == 0:
                print(describe(e), file=sys.stderr, flush=True)
            raise SystemExit(USER_ERROR) from None

    return wrapper  # type: ignore[return-value]


def warnings_once_per_run() -> None:
    """Python warnings shown by rank 0 only, each text once (a config check that runs in the launcher and again
    in the job would show its warning twice, from two call sites); a -W option or PYTHONWARNINGS decides alone."""
    if sys.warnoptions:
        return
    if rank() != 0:
        warnings.simplefilter("ignore")
        return
    # Not the "once" filter action: its registry is cleared whenever any code changes the filters (catch_warnings).
    shown: set[tuple[type, str]] = set()
    show = warnings.showwarning

    def show_once(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
        if (category, str(message)) not in shown:
            shown.add((category, str(message)))
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once


def hydra_main(config_path: str, config_name: str, renamed: dict[str, str] | None = None,
               replaced: dict[str, str] | None = None) -> Callable[[F], F]:
    """`hydra.main(config_path, config_name, version_base="1.3")` with user errors reported once, both those of
    the job (inside Hydra, which would otherwise print "Error executing job ..." on every rank) and Hydra's own
    composition errors (outside it), and Python warnings from rank 0 only. `renamed` (old key -> new) and
    `replaced` (old key -> what replaced it): an override of an old key is refused, naming what to use instead,
    before Hydra composes anything."""
    import hydra

    def decorate(task: F) -> F:
        full = os.environ.get("HYDRA_FULL_ERROR") == "1"  # when the launcher's module is imported
        hydra_task = hydra.main(config_path=config_path, config_name=config_name, version_base="1.3")(
            user_errors(task, full))

        @functools.wraps(hydra_task)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if renamed or replaced:
                from infra.config_keys import refuse_renamed

                refuse_renamed(sys.argv[1:], renamed or {}, replaced)
            return hydra_task(*args, **kwargs)

        outer = user_errors(inner, full)

        @functools.wraps(inner)
        def launcher(*args: Any, **kwargs: Any) -> Any:
            # Hydra otherwise prints its own report of a composition error (per rank) and exits 1: let it through.
            os.environ["HYDRA_FULL_ERROR"] = "1"
            warnings_once_per_run()
            return outer(*args, **kwargs)

        return launcher  # type: ignore[return-value]

    return decorate
