"""torch's process-wide settings a fix can change, and putting them back.

A fix that enables autocast globally, sets the default dtype, turns mkldnn off or changes
the thread count would change every cell computed after it in the same process. Forked
cell processes already confine a fix's changes to itself in the correctness phase; the timing
phase calls several fixes in one process, and the worker computes nothing of a case's own.
``snapshot`` / ``restore`` / ``changes`` let each place check that the settings it started
with are the settings it has, name what changed, and put them back.

Every setting is read through a getter that may not exist in an older torch (2.1 has no
``torch.backends.mha``, and reads autocast through per-device functions): what a release
lacks is simply not part of its snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from harness.measure.host import caches
from harness.schema.devices import CPU, DEVICE_KINDS
from harness.schema.records import Note, NoteKind, SettingChange

AUTOCAST_DEVICES = DEVICE_KINDS
#: The thread count: each worker sets it on purpose, so a worker's change of it is not news.
THREADS = "threads"


@dataclass(frozen=True)
class Setting:
    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]


def autocast_settings(device: str) -> list[Setting]:
    """Whether autocast is on for ``device``, and its dtype (new and old spellings)."""
    if _has_device_autocast_api():
        return [
            Setting(
                f"autocast({device})",
                lambda: torch.is_autocast_enabled(device),
                lambda on: torch.set_autocast_enabled(device, on),
            ),
            Setting(
                f"autocast dtype({device})",
                lambda: torch.get_autocast_dtype(device),
                lambda dtype: torch.set_autocast_dtype(device, dtype),
            ),
        ]
    if device == CPU:
        return [
            Setting(
                "autocast(cpu)", torch.is_autocast_cpu_enabled, torch.set_autocast_cpu_enabled
            ),
            Setting(
                "autocast dtype(cpu)", torch.get_autocast_cpu_dtype, torch.set_autocast_cpu_dtype
            ),
        ]
    return [
        Setting("autocast(cuda)", torch.is_autocast_enabled, torch.set_autocast_enabled),
        Setting(
            "autocast dtype(cuda)", torch.get_autocast_gpu_dtype, torch.set_autocast_gpu_dtype
        ),
    ]


def _has_device_autocast_api() -> bool:
    """torch 2.4+ reads and sets autocast per device type by name."""
    try:
        torch.is_autocast_enabled("cpu")
        return hasattr(torch, "set_autocast_dtype")
    except TypeError:
        return False


def _backend_flag(name: str, module: Any, attribute: str) -> Setting:
    return Setting(
        f"backends.{name}.{attribute}",
        lambda: getattr(module, attribute),
        lambda value: setattr(module, attribute, value),
    )


def _sdp_setting(kind: str) -> Setting | None:
    """One of the CUDA SDPA kernels' global switches, where this torch has it."""
    cuda = torch.backends.cuda
    get = getattr(cuda, f"{kind}_sdp_enabled", None)
    enable = getattr(cuda, f"enable_{kind}_sdp", None)
    if get is None or enable is None:
        return None
    return Setting(f"backends.cuda.{kind}_sdp", get, enable)


def known_settings() -> list[Setting]:
    settings = [s for device in AUTOCAST_DEVICES for s in autocast_settings(device)]
    settings += [
        Setting("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        Setting("grad enabled", torch.is_grad_enabled, torch._C._set_grad_enabled),
        Setting(THREADS, torch.get_num_threads, torch.set_num_threads),
        Setting(
            "float32 matmul precision",
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision,
        ),
        Setting(
            "deterministic algorithms",
            torch.are_deterministic_algorithms_enabled,
            torch.use_deterministic_algorithms,
        ),
        _backend_flag("mkldnn", torch.backends.mkldnn, "enabled"),
        _backend_flag("cudnn", torch.backends.cudnn, "enabled"),
        _backend_flag("cudnn", torch.backends.cudnn, "allow_tf32"),
        _backend_flag("cudnn", torch.backends.cudnn, "benchmark"),
        _backend_flag("cuda.matmul", torch.backends.cuda.matmul, "allow_tf32"),
    ]
    mha = getattr(torch.backends, "mha", None)
    if mha is not None:
        settings.append(
            Setting("backends.mha fastpath", mha.get_fastpath_enabled, mha.set_fastpath_enabled)
        )
    settings += [
        s for kind in ("flash", "mem_efficient", "math", "cudnn") if (s := _sdp_setting(kind))
    ]
    return settings


@caches.cache
def settings() -> list[Setting]:
    """The settings this build of torch can read (a getter may need CUDA support built in)."""
    return [s for s in known_settings() if _readable(s)]


def _readable(setting: Setting) -> bool:
    try:
        setting.get()
        return True
    except Exception:  # a getter this build cannot answer (no CUDA support compiled in)
        return False


State = dict[str, Any]


def snapshot() -> State:
    """Every global setting this torch has, by name."""
    return {s.name: s.get() for s in settings()}


def changes(before: State, after: State) -> list[SettingChange]:
    """What differs: each setting's name and its value before and after, as torch prints
    them (``default dtype``, ``torch.float32``, ``torch.bfloat16``)."""
    return [
        SettingChange(name, str(before[name]), str(after.get(name)))
        for name in before
        if after.get(name) != before[name]
    ]


def restore(state: State) -> list[SettingChange]:
    """Put every setting back to ``state``; returns what had changed."""
    now = snapshot()
    changed = changes(state, now)
    for setting in settings():
        if now[setting.name] != state[setting.name]:
            setting.set(state[setting.name])
    return changed


@contextmanager
def restored(found: list[SettingChange]) -> Iterator[None]:
    """Run a block and put torch's global settings back afterwards; what the block had
    changed is appended to ``found``."""
    state = snapshot()
    try:
        yield
    finally:
        found.extend(restore(state))


def worded(changed: Sequence[SettingChange]) -> list[str]:
    """Each change in words: ``default dtype torch.float32 -> torch.bfloat16``."""
    return [change.describe() for change in changed]


def describe(changed: Sequence[str]) -> str:
    """Changes in words (``worded``) as one clause: ``changed torch's global settings
    (default dtype torch.float32 -> torch.bfloat16; ...)``."""
    return "changed torch's global settings (" + "; ".join(changed) + ")"


def settled_note(state: State, whose: str) -> Note | None:
    """Put torch's settings back to ``state`` before a cell (a module's import, say, had
    changed them) and say so: ``the worker's changed torch's global settings (...) before
    this cell: put back``; None where nothing but the thread count (set on purpose) had
    changed."""
    changed = [change for change in restore(state) if change.name != THREADS]
    if not changed:
        return None
    text = f"{whose} {describe(worded(changed))} before this cell: put back"
    return Note(NoteKind.WORKER_SETTLED, text)
