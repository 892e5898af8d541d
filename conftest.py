# Tests run on the CPU: Triton kernels go through its interpreter, which must be chosen before
# triton is imported. Every test's warm starts go to a folder of its own under pytest's tmp dir
# ($ZEROS_CACHE, warmstart.cache_root): none lands in the repository's out/warmstart-cache, none
# is shared between tests (a session-wide one catches what runs outside a test, e.g. a module
# fixture).
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine


@pytest.fixture(autouse=True, scope="session")
def session_warmstart_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZEROS_CACHE", str(tmp_path_factory.mktemp("warmstart-cache")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def warmstart_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROS_CACHE", str(tmp_path / "warmstart-cache"))
