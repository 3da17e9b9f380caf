"""The process's global generators: Python's ``random`` and numpy's (the host's), and torch's with them.

NOTE [host RNG]
torch's checkpoint preserves torch's CPU and CUDA generator states for the replay
(``preserve_rng_state``); a forward that draws from Python's ``random`` or numpy's global
generator (drop-path written with ``random.random()``) would draw other numbers on replay,
take another branch and fail with CheckpointError, or silently compute something else. So
remat treats these two like torch's: the wrapper captures them before a region's forward
and rewinds them for its replay (then puts back what the step had reached), the profile's
hazard probe reports a draw as an RNG hazard naming the generator, and the profile's dry
runs (``rewinding``) and confirming replay rewind them too. A region Dynamo traces keeps
torch's own behaviour (NOTE [wrapper under compile]). One definition here, used by wrap, profile and verify.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Any, Callable, Iterator

import torch


def numpy_state() -> Any | None:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return np.random.get_state()


def numpy_equal(a: Any, b: Any) -> bool:
    import numpy as np
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostRng:
    """Python's ``random`` and numpy's global generator states at one moment (NOTE [host RNG])."""

    python: Any
    numpy: Any | None

    @classmethod
    def capture(cls) -> "HostRng":
        return cls(python=random.getstate(), numpy=numpy_state())

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np
            np.random.set_state(self.numpy)

    def differences(self, other: "HostRng") -> list[str]:
        """Which of the two generators are in another state (``["python random", "numpy random"]``)."""
        out = []
        if self.python != other.python:
            out.append("python random")
        if self.numpy is not None and other.numpy is not None and not numpy_equal(self.numpy, other.numpy):
            out.append("numpy random")
        return out


@contextlib.contextmanager
def rewound(state: HostRng) -> Iterator[None]:
    """Both generators at ``state`` for the duration, then where they were on entry."""
    now = HostRng.capture()
    state.restore()
    try:
        yield
    finally:
        now.restore()


def rewinding(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for one checkpoint call: its later calls (the replays) run with both generators as
    they were when ``rewinding`` was called, right before the first (NOTE [host RNG])."""
    state = HostRng.capture()
    calls = [0]

    def run(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*args, **kwargs)
        with rewound(state):
            return fn(*args, **kwargs)
    return run


# -- every generator: torch's and the host's ---------------------------------------------

@dataclasses.dataclass(kw_only=True)
class RngState:
    """Every global generator a training step may draw from."""

    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] | None
    python: Any
    numpy: Any | None

    @classmethod
    def capture(cls) -> "RngState":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(torch_cpu=torch.get_rng_state(), torch_cuda=cuda, python=random.getstate(), numpy=numpy_state())

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np
            np.random.set_state(self.numpy)

    def differences(self, other: "RngState") -> list[str]:
        """Which generators are in a different state (``["torch cpu", "python random"]``)."""
        out = []
        if not torch.equal(self.torch_cpu, other.torch_cpu):
            out.append("torch cpu")
        if (self.torch_cuda is None) != (other.torch_cuda is None) or (
                self.torch_cuda is not None and other.torch_cuda is not None
                and any(not torch.equal(a, b) for a, b in zip(self.torch_cuda, other.torch_cuda))):
            out.append("torch cuda")
        if self.python != other.python:
            out.append("python random")
        if self.numpy is not None and other.numpy is not None and not numpy_equal(self.numpy, other.numpy):
            out.append("numpy random")
        return out


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
