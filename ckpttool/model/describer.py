"""The short-lived subprocess that describes a config with transformers, started as soon as the config is read.

:mod:`ckpttool.model.architecture` describes a config not in the cache in a fresh interpreter, so that importing
transformers (seconds of CPU, a few hundred MiB the allocator keeps) never happens in the merging process. Nearly
all of a first description's time is that interpreter's imports (``torch``, ``transformers`` and what its modeling
code pulls in: ``torch.distributed.tensor``, ``torch._dynamo``, ``torch.distributed.checkpoint``, accelerate); building
the model on the meta device and walking it take a few hundredths of a second. So the process is started at once
(:class:`DescribingProcess`) and its answer read only when it is needed (:meth:`DescribingProcess.answer`): a caller
that has other work to do first (reading a checkpoint's headers) overlaps the two on a second core.

Its request, answer and error go through unnamed temporary files, not pipes, so that neither process ever waits for
the other to read: the caller is busy elsewhere, and a child that dies early never reads its request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.model.description import ModelInfo, from_doc

#: where a config not in the cache is described: ``subprocess``, ``inline`` (this process), or unset: in a subprocess
#: unless transformers is already imported here (its memory is spent; a subprocess would only add seconds)
DESCRIBE_ENV = "CKPTTOOL_DESCRIBE"

#: what the subprocess runs, after putting this ckpttool first on its path: the entry point that reads the request
ENTRY = "from ckpttool.model.architecture import describe_main; describe_main()"


def describe_mode() -> str:
    """``"subprocess"`` or ``"inline"``: where a config not in the cache is described (:data:`DESCRIBE_ENV`).

    Raises:
        ArgumentError: :data:`DESCRIBE_ENV` has another value.
    """
    mode = os.environ.get(DESCRIBE_ENV) or ("inline" if "transformers" in sys.modules else "subprocess")
    if mode not in ("subprocess", "inline"):
        raise ArgumentError(f"{DESCRIBE_ENV}={mode!r}: expected 'subprocess' or 'inline' (describe the architecture "
                            "in this process)")
    return mode


class CannotSpawn(Exception):
    """No subprocess can describe the config (no interpreter, no fork, a config that is not JSON)."""


class DescribingProcess:
    """A subprocess describing ``config``, started by the constructor; :meth:`answer` waits for it, :meth:`close`
    stops it if its answer is not wanted. A process that could not be started says why in :meth:`answer`
    (:class:`CannotSpawn`), so that the caller decides there what to do instead.

    Example:
        >>> with DescribingProcess("llama", config, "config.json") as child:  # doctest: +SKIP
        ...     layout = read_headers()  # meanwhile, on another core
        ...     info, peak_rss = child.answer()
    """

    def __init__(self, model_type: str, config: Mapping[str, object], label: str) -> None:
        self.model_type, self.config, self.label = model_type, config, label
        self.started = time.perf_counter()
        self._cannot: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._files: tuple[IO[bytes], IO[bytes]] | None = None
        try:
            request = json.dumps({"config": config, "label": label}).encode()
        except (TypeError, ValueError) as e:  # a config handed over by a library caller, with non-JSON values
            self._cannot = f"the config is not JSON: {e}"
            return
        if not sys.executable:
            self._cannot = "no Python interpreter path (sys.executable is empty)"
            return
        package = str(Path(__file__).resolve().parent.parent.parent)  # the same ckpttool, wherever it was imported from
        code = f"import sys; sys.path.insert(0, {package!r}); {ENTRY}"
        try:  # the request from a file too: a pipe would block this process on a config larger than its buffer
            with tempfile.TemporaryFile() as asked:
                asked.write(request)
                asked.seek(0)
                self._files = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
                self._process = subprocess.Popen([sys.executable, "-c", code], stdin=asked,
                                                 stdout=self._files[0], stderr=self._files[1])
        except OSError as e:
            self.close()
            self._cannot = str(e)

    def answer(self) -> tuple[ModelInfo | None, int]:
        """Wait for the subprocess: the description (None: transformers builds no model of it) and its peak RSS.

        Raises:
            CannotSpawn: the process could not be started (the message says why).
            ConfigError: transformers rejects the config (its own words, as in this process), or the process failed
                (the message names the config and the reason: its last line of stderr, a signal, an exit status).
        """
        if self._cannot is not None or self._process is None or self._files is None:
            raise CannotSpawn(self._cannot or "the subprocess was stopped")
        returncode = self._process.wait()
        out, err = (self._read(f) for f in self._files)
        self.close()
        lines = [line.strip() for line in err.splitlines() if line.strip()]
        signals = {s.value: s.name for s in signal.Signals}
        reason = (f"killed by {signals.get(-returncode, f'signal {-returncode}')}" if returncode < 0
                  else lines[-1] if lines else f"exit status {returncode}")
        if returncode == 0:
            try:
                answer = json.loads(out)
                error = answer.get("error")
                info = None if answer.get("none") or error is not None else from_doc(answer, self.config)
                peak = int(answer.get("peak", 0))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                reason = f"its answer is not a description: {e}"
            else:
                if error is not None:  # transformers' own refusal, worded as in this process
                    raise ConfigError(str(error))
                return info, peak
        raise ConfigError(f"'{self.label}': describing the {self.model_type} architecture with transformers in a "
                          f"subprocess failed ({reason}). Set {DESCRIBE_ENV}=inline to describe it in this process")

    def close(self) -> None:
        """Stop the subprocess if it still runs (its answer is not wanted) and free its files; idempotent."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process = None
        for file in self._files or ():
            file.close()
        self._files = None

    def __enter__(self) -> DescribingProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _read(file: IO[bytes]) -> str:
        file.seek(0)
        return file.read().decode("utf-8", errors="replace")
