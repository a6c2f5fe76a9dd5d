"""Test tiers (DESIGN.md): reference tests run everywhere; ``compile`` needs TileLang and nvcc;
``gpu`` needs CUDA. Each test is seeded from its node id; the seed is printed when it fails."""
import importlib.util
import os
import shutil
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
HAS_NVCC = shutil.which("nvcc") is not None


def pytest_configure(config):
    """With ``TILEFUSE_LIB_LOG=FILE``, append the path of every kernel library the tests look up to FILE (each
    process appends; ``tools/pack_kernel_cache.sh`` packs the libraries the compile tier built)."""
    log = os.environ.get("TILEFUSE_LIB_LOG")
    if not log:
        return
    from tilefuse import _jit

    lib_path = _jit._lib_path

    def logged(name, config_, arch):
        path = lib_path(name, config_, arch)
        with open(log, "a") as f:
            f.write(path + "\n")
        return path

    _jit._lib_path = logged


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_compile = pytest.mark.skip(reason="needs TileLang and nvcc")
    for item in items:
        if "knob_kernels" in getattr(item, "fixturenames", ()):  # compiles its kernels on the device: slow
            item.add_marker(pytest.mark.knobs)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "compile" in item.keywords and not (HAS_TILELANG and HAS_NVCC):
            item.add_marker(skip_compile)


@pytest.fixture(autouse=True)
def seed(request):
    """Seed torch (CPU and CUDA) from the test id, so a test's data never depends on test order."""
    value = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    torch.manual_seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(autouse=True)
def release_gpu_memory(request):
    """After a GPU test, hand the blocks torch's allocator cached back to the driver: the tier runs in parallel
    processes on one card, and one worker's cache must not starve another's allocation (on an 80 GB H100 at
    ``-n 8``, workers holding 30 and 34 GiB of cache made others' 0.5-1 GiB allocations fail)."""
    yield
    if HAS_CUDA and request.node.get_closest_marker("gpu") is not None:
        torch.cuda.empty_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"torch.manual_seed({value})"))


@pytest.fixture
def knob_kernels(monkeypatch):
    """``apply(module, knobs)``: set a kernel module's knobs (``_jit.knobs`` names) for this test and route every
    ``_jit.get`` through kernels compiled here, outside the in-process and disk caches (whose keys hold the
    module's knob values only as set at import)."""
    from tilefuse import _jit

    def apply(module, knobs: dict) -> None:
        import tilelang

        for name, value in knobs.items():
            monkeypatch.setattr(module, name, value)
        if hasattr(module, "_PLANS"):  # launch closures built before hold the default kernels
            monkeypatch.setattr(module, "_PLANS", {})
        built = {}

        def get(name, cfg):
            if (name, cfg) not in built:
                built[name, cfg] = tilelang.compile(
                    _jit._FACTORIES[name][0](*cfg), target={"kind": "cuda", "arch": _jit.current_arch()},
                    execution_backend="tvm_ffi", pass_configs=dict(_jit._PASS_CONFIGS))
            return built[name, cfg]

        monkeypatch.setattr(_jit, "get", get)

    return apply


@pytest.fixture
def poison_outputs(monkeypatch):
    """``poison_outputs(module)``: the module's ``_new`` (where its launchers allocate their outputs) hands out
    buffers filled with NaN, so an output element a kernel fails to write shows."""
    def poison(module):
        monkeypatch.setattr(module, "_new", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                   device=device))

    return poison
