"""The native launch plans (``tilefuse._native``).

Compile tier (a host compiler, torch and tvm_ffi headers; no GPU): the extension builds; each plan hands
the kernel exactly the tensors it returns (shapes, strides, dtypes as DLPack types equal to torch's own
export), copies rows the kernel cannot read in place, skips the launch at zero rows, and raises the
kernel's error. The kernel here is a Python function behind TVM-FFI that records what it receives.
GPU tier: the public ops on the native plan equal the Python launch path bitwise (outputs poisoned), and
their outputs are ordinary caching-allocator tensors (``record_stream`` takes them).
"""
import pytest
import torch

from tilefuse import _native

pytestmark = []


@pytest.fixture(scope="module")
def native():
    mod = _native.module()
    assert mod is not None, _native.error()
    return mod


def _recorder():
    import tvm_ffi

    seen = []

    def kernel(*args):
        seen.append([(tuple(a.shape), tuple(a.strides), str(a.dtype)) for a in args])

    return tvm_ffi.convert(kernel), seen


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order (a dense copy first: ``contiguous()`` keeps a (t, 1) column-major
    tensor's padded stride, which a byte view refuses)."""
    return t.clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _desc(t: torch.Tensor):
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""))


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32,
                                   torch.int64, torch.bool], ids=str)
def test_dlpack_dtype_matches_torch_export(native, dtype):
    import tvm_ffi

    d = tvm_ffi.from_dlpack(torch.empty(2, dtype=dtype)).dtype
    assert native.dl_dtype_code(dtype) == (d.type_code, d.bits, d.lanes)


@pytest.mark.compile
@pytest.mark.parametrize("t", [0, 1, 5, 8])
@pytest.mark.parametrize("outs", [
    [(7168, torch.float8_e4m3fn, False), (56, torch.float32, False)],
    [(3584, torch.int8, False), (14, torch.int32, True)],
    [(56, torch.float32, True)],
    [(64, torch.uint8, False), (2, torch.float32, True), (1, torch.int32, False)],
], ids=["e4m3-row", "e2m1-col-packed", "sf-only-col", "three"])
def test_plan_allocates_and_launches(native, t, outs):
    fn, seen = _recorder()
    plan = _native.plan(fn, torch.bfloat16, 16, 8, outs)
    x = torch.randn(t, 7168).to(torch.bfloat16)
    got = plan(x, t)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(outs)
    for y, (cols, dtype, col) in zip(got, outs):
        assert y.shape == (t, cols) and y.dtype == dtype and y.device == x.device
        assert y.stride() == ((1, (t + 3) // 4 * 4) if col else (cols, 1))
        assert y.untyped_storage().data_ptr() == y.data_ptr()  # its own allocation, not a view of another
    if t == 0:
        assert seen == []
    else:
        assert seen == [[_desc(x)] + [_desc(y) for y in got]]
    again = plan(x, t)
    again = again if isinstance(again, tuple) else (again,)
    if t:
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(got, again))  # fresh outputs per call


@pytest.mark.compile
@pytest.mark.parametrize("width,offset,in_place", [(7168, 0, True), (7168 + 64, 0, True), (7168 + 3, 0, False),
                                                   (7168 + 64, 8, True), (7168 + 64, 3, False)], ids=str)
def test_plan_copies_rows_the_kernel_cannot_read(native, width, offset, in_place):
    """Row stride a multiple of 8 elements and a 16-byte aligned start pass as they are; others are copied."""
    fn, seen = _recorder()
    plan = _native.plan(fn, torch.bfloat16, 16, 8, [(56, torch.float32, False)])
    base = torch.randn(3, width + 8).to(torch.bfloat16)
    x = base[:, offset:offset + 7168]
    plan(x, 3)
    assert seen[0][0] == ((3, 7168), (x.stride(0) if in_place else 7168, 1), "bfloat16")
    seen.clear()
    plan(x[:1], 1)  # one row: any row stride, the start alignment still counts
    assert seen[0][0] == ((1, 7168), (x.stride(0) if (offset * 2) % 16 == 0 else 7168, 1), "bfloat16")


@pytest.mark.compile
def test_plan_raises_the_kernel_error(native):
    import tvm_ffi

    def kernel(*args):
        raise ValueError("kernel says no")

    plan = _native.plan(tvm_ffi.convert(kernel), torch.bfloat16, 16, 8, [(4, torch.float32, False)])
    with pytest.raises(Exception, match="kernel says no"):
        plan(torch.zeros(2, 64, dtype=torch.bfloat16), 2)


@pytest.mark.compile
def test_plan_declines_non_ffi_kernels_and_bad_outputs(native):
    assert _native.plan(lambda *a: None, torch.bfloat16, 16, 8, [(4, torch.float32, False)]) is None
    fn, _ = _recorder()
    with pytest.raises(ValueError, match="1 to 3 outputs"):
        _native.plan(fn, torch.bfloat16, 16, 8, [(4, torch.float32, False)] * 4)


def test_the_extension_builds_where_there_is_a_compiler():
    """Not the compile tier: wherever a C++ compiler is, the extension must build against the installed torch
    and load (a failure here is the reason the launchers would lose their native plans). Only a machine without
    a compiler falls back silently."""
    if _native.compiler() is None:
        pytest.skip("no C++ compiler ($CXX or c++): the launchers take their Python path")
    assert _native.enabled(), "TILEFUSE_NATIVE=0 is set: unset it to test the native launcher"
    assert _native.module() is not None, _native.error()
    assert _native.status() == ("ready", _native.lib_path())


@pytest.mark.parametrize("show,std", [("C++ Version: 201703\n", "c++17"), ("C++ Version: 202002\n", "c++20"),
                                      ("C++ Version: 202100\n", "c++23"), ("  - GCC 13.3\n", "c++20")])
def test_cxx_std_follows_torch_build_config(monkeypatch, show, std):
    """-std= is the standard torch was compiled with, as torch.__config__ states it (torch 2.10: C++17; 2.13 and
    2.14: C++20, whose headers need it); C++20 where the config does not say."""
    monkeypatch.setattr(torch.__config__, "show", lambda: show)
    assert _native.cxx_std() == std


def test_build_flags_use_torchs_standard():
    pytest.importorskip("tvm_ffi")
    cflags, _ = _native._flags()
    assert [f for f in cflags if f.startswith("-std=")] == [f"-std={_native.cxx_std()}"]


def _fresh(monkeypatch, tmp_path):
    """A module state of its own, its library path under tmp_path (nothing built there)."""
    monkeypatch.setattr(_native, "_STATE", {})
    monkeypatch.setattr(_native, "lib_path", lambda: str(tmp_path / "tilefuse_native-test.so"))
    monkeypatch.delenv("TILEFUSE_NATIVE", raising=False)


def test_disabled_or_unbuildable_falls_back(monkeypatch, tmp_path, recwarn):
    """TILEFUSE_NATIVE=0, no compiler, or a failing build gives no plan (the launchers keep their Python path).
    Only the failing build warns; its reason stays beside the library for status() in later processes."""
    _fresh(monkeypatch, tmp_path)
    assert _native.status() == ("not built", "it builds on first use (15-25 s)") or _native.compiler() is None
    monkeypatch.setenv("TILEFUSE_NATIVE", "0")
    assert _native.module() is None and _native.plan(object(), torch.bfloat16, 16, 8, [(4, torch.float32, False)]) is None
    assert _native.status()[0] == "disabled"

    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("CXX", "tilefuse-no-such-compiler")
    assert _native.status() == ("no compiler", "tilefuse-no-such-compiler is not on the PATH (set CXX): the "
                                               "launchers take their Python path")
    assert _native.module() is None
    assert _native.error() == "no C++ compiler (tilefuse-no-such-compiler is not on the PATH; set CXX)"
    assert _native.status()[0] == "no compiler"
    assert not recwarn.list, "no compiler: the fallback is silent"

    _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(_native, "compiler", lambda: ["c++"])

    def broken(path=None):
        raise RuntimeError("c++ -std=c++20 failed on _native.cc: error: something\nmore lines")

    monkeypatch.setattr(_native, "build", broken)
    with pytest.warns(RuntimeWarning, match="error: something"):
        assert _native.module() is None
    assert "error: something" in _native.error()
    failed = ("failed", "RuntimeError: c++ -std=c++20 failed on _native.cc: error: something")
    assert _native.status() == failed
    monkeypatch.setattr(_native, "_STATE", {})  # another process: the reason left beside the library
    assert _native.status() == failed


def test_status_without_the_headers_to_build_against(monkeypatch):
    """status() answers (it never raises) where the extension's inputs are missing: info prints it."""
    monkeypatch.setattr(_native, "_STATE", {})
    monkeypatch.delenv("TILEFUSE_NATIVE", raising=False)

    def missing():
        raise ImportError("No module named 'tvm_ffi'\nmore")

    monkeypatch.setattr(_native, "lib_path", missing)
    assert _native.status() == ("failed", "ImportError: No module named 'tvm_ffi'")


def test_a_failing_compiler_names_its_first_error(monkeypatch, tmp_path):
    """build() with a compiler that rejects the source raises RuntimeError whose first line names the compiler's
    first ``error:`` line, and leaves no library behind."""
    pytest.importorskip("tvm_ffi")
    if _native.compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("CXX", f"{_native.compiler()[0]} -include tilefuse_no_such_header.h")
    path = str(tmp_path / "broken.so")
    with pytest.raises(RuntimeError) as info:
        _native.build(path)
    first = str(info.value).splitlines()[0]
    cxx = _native.compiler()[0]
    assert first.startswith(f"{cxx} -std={_native.cxx_std()} failed on _native.cc: ")
    assert "tilefuse_no_such_header.h" in first
    assert not (tmp_path / "broken.so").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("flags", [(False, False, False), (False, True, False), (True, False, False),
                                   (True, True, True)], ids=str)
@pytest.mark.parametrize("t", [1, 7, 4001])
def test_native_equals_python_launch_path(native, fmt, flags, t):
    from tilefuse.quant import _per_token_cast_kernel as K

    col, round_sf, packed = flags
    x = (torch.randn(t, 7168 + 64, device="cuda") * 3).to(torch.bfloat16)[:, :7168]
    for mode in ("cast", "sf_only"):
        key = (x.dtype, 7168, None, fmt, 128, None, col, round_sf, packed, mode)
        fast, slow = K._plan(*key), K._plan(*key, native=False)
        assert type(fast).__module__ == "tilefuse_native"
        got, want = fast(x, t), slow(x, t)
        got, want = (got, want) if mode == "cast" else ((got,), (want,))
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            assert torch.equal(_bytes(a), _bytes(b))


@pytest.mark.gpu
def test_native_outputs_take_record_stream(native):
    """The outputs come from torch's caching allocator, so record_stream holds their memory for a side
    stream: freed while the side stream still has work on it, the block is not handed out again (a tensor
    wrapped from foreign memory would ignore record_stream and be reused at once)."""
    from tilefuse.quant import _per_token_cast_kernel as K, per_token_cast

    x = torch.randn(64, 7168, device="cuda").to(torch.bfloat16)
    assert type(K.launcher(x.dtype, 7168, None, "e4m3", 128)).__module__ == "tilefuse_native"
    out, sf = per_token_cast(x, "e4m3", 128)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy well past the allocation below
        seen = out.view(torch.uint8).clone()
    out.record_stream(side)
    ptr, nbytes = out.data_ptr(), out.numel()
    del out
    again = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    assert again.data_ptr() != ptr
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), per_token_cast(x.cpu(), "e4m3", 128)[0].view(torch.uint8))


@pytest.mark.compile
@pytest.mark.parametrize("t", [1, 7, 130])
@pytest.mark.parametrize("x_dtype,fmt", [(torch.bfloat16, "e4m3"), (torch.bfloat16, "e2m1"), (torch.float32, "e2m1")],
                         ids=str)
@pytest.mark.parametrize("block", [(32, 128), (128, 128), (32, 32)], ids=str)
@pytest.mark.parametrize("flags", [(False, False, False), (True, True, False), (True, True, True)], ids=str)
@pytest.mark.parametrize("mode", ["cast", "sf_only"])
def test_per_block_plan_matches_python_launch(native, monkeypatch, t, x_dtype, fmt, block, flags, mode):
    """per_block_cast's native plan hands the kernel the same tensors as its Python path (storage views,
    int32 words of e2m1 outputs and of bf16 inputs, (words, pad, 4) bytes of packed sf) and returns the same
    layouts."""
    from tilefuse import _jit
    from tilefuse.quant import _per_block_cast_kernel as KB

    fn, seen = _recorder()
    monkeypatch.setattr(_jit, "get", lambda name, cfg: fn)
    monkeypatch.setattr(KB, "_PLANS", {})
    x = torch.randn(t, 512).to(x_dtype)
    got = KB.per_block_cast_launch(x, fmt, block, *flags, mode=mode)
    assert type(KB._PLANS[next(iter(KB._PLANS))]).__module__ == "tilefuse_native"
    monkeypatch.setattr(KB, "native_launcher", lambda *a: None)
    want = KB.per_block_cast_launch(x, fmt, block, *flags, mode=mode)
    assert len(seen) == 2 and seen[0] == seen[1]
    got, want = (got, want) if mode == "cast" else ((got,), (want,))
    assert [_desc(g) for g in got] == [_desc(w) for w in want]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block,flags,sf_only", [  # registered static configs (the packed kernel cache)
    ("e4m3", (128, 128), (True, True, True), True), ("e4m3", (128, 128), (False, False, False), True),
    ("e2m1", (32, 32), (False, True, False), False), ("e2m1", (128, 128), (True, True, True), False),
    ("e4m3", (32, 32), (True, True, True), False)], ids=str)
@pytest.mark.parametrize("t", [1, 7, 4001])
def test_per_block_native_equals_python_launch_path(native, monkeypatch, fmt, block, flags, sf_only, t):
    """The public per_block_cast (and its sf-only twin) on the native plan equal the Python launch path bitwise,
    strides included (outputs poisoned: the tier's allocator fill)."""
    from tilefuse import quant as q
    from tilefuse.quant import _per_block_cast_kernel as KB

    x = (torch.randn(t, 7168, device="cuda") * 3).to(torch.bfloat16)
    got = list(q.per_block_cast(x, fmt, block, *flags))
    if sf_only:
        got.append(q.per_block_cast_with_sf_only(x, fmt, block, *flags))
    assert any(type(p).__module__ == "tilefuse_native" for p in KB._PLANS.values())
    monkeypatch.setattr(KB, "native_launcher", lambda *a: None)
    want = list(KB.per_block_cast_launch(x, fmt, block, *flags))
    if sf_only:
        want.append(KB.per_block_cast_launch(x, fmt, block, *flags, mode="sf_only"))
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert torch.equal(_bytes(a), _bytes(b))


@pytest.mark.compile
@pytest.mark.parametrize("t", [1, 7, 130])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("flags", [(False, False, False), (True, True, False), (True, True, True)], ids=str)
def test_e5m6_plan_matches_python_launch(native, monkeypatch, t, x_dtype, flags):
    """per_token_cast_to_e5m6's native plan hands the kernel the Python path's tensors (uint32 words of the
    uint8 output, the sf storage or its bytes) and returns the same layouts."""
    from tilefuse import _jit
    from tilefuse.quant import _e5m6_kernel as KE

    fn, seen = _recorder()
    monkeypatch.setattr(_jit, "get", lambda name, cfg: fn)
    monkeypatch.setattr(KE, "_PLANS", {})
    x = torch.randn(t, 512).to(x_dtype)
    got = KE.e5m6_cast_launch(x, 512, *flags)
    assert type(next(iter(KE._PLANS.values()))).__module__ == "tilefuse_native"
    monkeypatch.setattr(KE, "native_launcher", lambda *a: None)
    want = KE.e5m6_cast_launch(x, 512, *flags)
    assert len(seen) == 2 and seen[0] == seen[1]
    assert [_desc(g) for g in got] == [_desc(w) for w in want]


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [(False, True, False), (True, True, True)], ids=str)
@pytest.mark.parametrize("t", [1, 7, 4001])
def test_e5m6_native_equals_python_launch_path(native, monkeypatch, flags, t):
    from tilefuse import quant as q
    from tilefuse.quant import _e5m6_kernel as KE

    x = (torch.randn(t, 7168, device="cuda") * 3).to(torch.bfloat16)
    got = q.per_token_cast_to_e5m6(x, 7168, *flags)
    assert any(type(p).__module__ == "tilefuse_native" for p in KE._PLANS.values())
    monkeypatch.setattr(KE, "native_launcher", lambda *a: None)
    want = KE.e5m6_cast_launch(x, 7168, *flags)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        if a.dtype == torch.int32:  # packed UE8M0, one block per row: byte 0 of each word (the rest is padding)
            assert torch.equal(_bytes(a)[:, :1], _bytes(b)[:, :1])
        else:
            assert torch.equal(_bytes(a), _bytes(b))


def _pairs(t: int, h: int):
    """(name, (data, sf), block, special) pre-quantized inputs of every data format and sf layout."""
    from tilefuse.reference import quant as R

    x = torch.randn(t, h)
    out = []
    for fmt, col, packed in (("e4m3", False, False), ("e4m3", True, True), ("e2m1", True, False)):
        out.append((f"{fmt}-col{col}-packed{packed}",
                    R.cast(x, fmt, (1, 128), round_sf=True, use_tma_aligned_col_major_sf=col,
                           use_packed_ue8m0=packed), (1, 128), None))
    out.append(("e4m3-block128", R.cast(x, "e4m3", (128, 128)), (128, 128), None))
    out.append(("e5m6", R.cast_to_e5m6(x, h, False, True, False), (1, h), "e5m6"))
    return out


@pytest.mark.compile
@pytest.mark.parametrize("t", [1, 7, 130])
@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
def test_cast_back_plan_matches_python_launch(native, monkeypatch, t, case, fmt):
    """The cast-back native plan hands the kernel the Python path's tensors (uint8 bytes of e2m1 data, int32
    words of e5m6 data, the sf as given) and returns the same output layout."""
    from tilefuse import _jit
    from tilefuse.quant import _cast_back_kernel as KC

    name, (data, sf), block, special = _pairs(t, 512)[case]
    fn, seen = _recorder()
    monkeypatch.setattr(_jit, "get", lambda n, cfg: fn)
    monkeypatch.setattr(KC, "_PLANS", {})
    got = KC.cast_back_launch(data, sf, fmt, block, special)
    assert type(next(iter(KC._PLANS.values()))[0]).__module__ == "tilefuse_native"
    monkeypatch.setattr(KC, "native_launcher", lambda *a: (None, 0))
    want = KC.cast_back_launch(data, sf, fmt, block, special)
    assert len(seen) == 2 and seen[0] == seen[1], name
    assert _desc(got) == _desc(want)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 4001])
@pytest.mark.parametrize("case", range(5))
def test_cast_back_native_equals_python_launch_path(native, monkeypatch, t, case):
    """The public cast-back ops on the native plan (the validated fast path on the second call) equal the
    Python launch path bitwise."""
    from tilefuse import quant as q
    from tilefuse.quant import _cast_back_kernel as KC

    name, (data, sf), block, special = _pairs(t, 7168)[case]
    data, sf = data.cuda(), sf.cuda()
    if special:
        call = lambda: q.cast_back_e5m6((data, sf), "bf16", block)  # noqa: E731
    elif block[0] == 1:
        call = lambda: q.per_token_cast_back((data, sf), "bf16", block[1])  # noqa: E731
    else:
        call = lambda: q.cast_back((data, sf), "bf16", block)  # noqa: E731
    first, second = call(), call()
    assert any(p[0] is not None for p in KC._PLANS.values())
    monkeypatch.setattr(KC, "native_launcher", lambda *a: (None, 0))
    want = KC.cast_back_launch(data, sf, "bf16", block, special)
    for got in (first, second):
        assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


def _scalar_recorder():
    """A TVM-FFI kernel recording each argument: a tensor's (shape, strides, dtype), a scalar's value."""
    import tvm_ffi

    seen = []

    def kernel(*args):
        seen.append([(tuple(a.shape), tuple(a.strides), str(a.dtype)) if hasattr(a, "shape") else ("scalar", a)
                     for a in args])

    return tvm_ffi.convert(kernel), seen


def _assert_same_layouts(got, want):
    """Each output None in both, or of the same shape, strides and dtype."""
    for g, e in zip(got, want, strict=True):
        assert (g is None) == (e is None)
        if g is not None:
            assert _desc(g) == _desc(e)


def _assert_same_outputs(got, want):
    """Each output None in both, or equal bitwise with the same shape, strides and dtype."""
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            assert torch.equal(_bytes(a), _bytes(b))


_NORM_CASES = [(False, "row", False, False), (False, "row", False, True), (True, "row", False, True),
               (True, "row_packed", True, False), (True, "col", True, True), (True, "col_packed", True, True)]


@pytest.mark.compile
@pytest.mark.parametrize("t", [1, 5, 8])
@pytest.mark.parametrize("case", _NORM_CASES, ids=str)  # (quant, sf layout, round_sf, with_rstd)
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("offset", [0, 1])  # x and the weight 2 bytes past a 16-byte boundary: copied
def test_norm_plan_matches_python_launch(native, monkeypatch, t, case, weight, offset):
    """The RMSNorm forward's native plan hands the kernel the same arguments as its Python path ((1, T, H) row
    views with size-1 strides 0, sf per layout, rstd, one-element placeholders, eps and out_scale) and returns the
    same layouts."""
    from tilefuse import _jit
    from tilefuse.quant import _norm_kernel as KN

    fn, seen = _scalar_recorder()
    monkeypatch.setattr(_jit, "get", lambda name, cfg: fn)
    monkeypatch.setattr(KN, "_PLANS", {})
    quant, layout, round_sf, with_rstd = case
    h = 2048
    x = torch.randn(t, h + 64).to(torch.bfloat16)[:, offset:offset + h]   # row stride h + 64
    w = torch.randn(h + 8).to(torch.bfloat16)[offset:offset + h] if weight else None
    args = dict(with_rstd=with_rstd, quant=quant, use_tma_aligned_col_major_sf=layout.startswith("col"),
                round_sf=round_sf, use_packed_ue8m0=layout.endswith("packed"))
    got = KN.norm_forward_launch(x, w, 1e-6, None, 0.5, **args)
    assert type(next(iter(KN._PLANS.values()))).__module__ == "tilefuse_native"
    monkeypatch.setattr(KN, "_plan", lambda *a: None)
    want = KN.norm_forward_launch(x, w, 1e-6, None, 0.5, **args)
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0][-2:] == [("scalar", 1e-6), ("scalar", 0.5)]
    assert seen[0][0] == ((1, t, h), (0, (h + 64 if offset == 0 else h) if t > 1 else 0, 1), "bfloat16")
    _assert_same_layouts(got, want)


@pytest.mark.compile
@pytest.mark.parametrize("t", [1, 5, 8])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("offset", [0, 1])  # out_grad, x and the weight one element past their aligned start
def test_norm_backward_plan_matches_python_launch(native, monkeypatch, t, x_dtype, weight, offset):
    """The RMSNorm backward's native plan launches the dx kernel and (with a weight) the assigning weight-gradient
    reduce with the Python path's arguments, and returns the same layouts (weight_grad None without a weight)."""
    from tilefuse import _jit
    from tilefuse.quant import _norm_kernel as KN

    fn, seen = _scalar_recorder()
    names = []
    monkeypatch.setattr(_jit, "get", lambda name, cfg: (names.append((name, cfg)), fn)[1])
    monkeypatch.setattr(KN, "_PLANS", {})
    h = 2048
    x = torch.randn(t, h + 64).to(x_dtype)[:, offset:offset + h]
    dy = torch.randn(t, h + 32).to(x_dtype)[:, offset:offset + h]
    w = torch.randn(h + 8).to(x_dtype)[offset:offset + h] if weight else None
    rstd = torch.rand(t)
    got = KN.norm_backward_launch(dy, x, w, rstd, None, 0.75)
    assert type(next(iter(KN._PLANS.values()))).__module__ == "tilefuse_native"
    plan_names = list(names)
    monkeypatch.setattr(KN, "_backward_plan", lambda *a: None)
    want = KN.norm_backward_launch(dy, x, w, rstd, None, 0.75)
    launches = 2 if weight else 1
    assert len(seen) == 2 * launches and seen[:launches] == seen[launches:]
    assert seen[0][-1] == ("scalar", 0.75)
    assert sorted(plan_names) == sorted(names[len(plan_names):])   # the same kernel configs
    _assert_same_layouts(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 4001])
@pytest.mark.parametrize("case", _NORM_CASES, ids=str)  # (quant, sf layout, round_sf, with_rstd)
@pytest.mark.parametrize("offset", [0, 1])
def test_norm_native_equals_python_launch_path(native, monkeypatch, t, case, offset):
    """The public RMSNorm forward ops on the native plan (the validated fast path on the second call) equal the
    Python launch path bitwise, strides included; misaligned x and weight too."""
    from tilefuse.quant import _norm_kernel as KN, norm as N

    quant, layout, round_sf, with_rstd = case
    col, packed = layout.startswith("col"), layout.endswith("packed")
    h = 7168
    x = (torch.randn(t, h + 64, device="cuda") * 3).to(torch.bfloat16)[:, offset:offset + h]
    w = torch.randn(h + 8, device="cuda").to(torch.bfloat16)[offset:offset + h]

    def call():
        if quant:
            (d, sf), _, rstd, _ = N.norm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", 32, None, 0.5, col, round_sf,
                                                                    packed, with_rstd=with_rstd)
            return d, sf, rstd
        o, rstd, _ = N.norm_forward(x, w, 1e-6, out_scale=0.5, with_rstd=with_rstd)
        return o, None, rstd

    first, second = call(), call()
    assert any(type(p).__module__ == "tilefuse_native" for p in KN._PLANS.values())
    monkeypatch.setattr(KN, "_plan", lambda *a: None)
    o, sf, _, rstd, _ = KN.norm_forward_launch(x, w, 1e-6, None, 0.5, with_rstd=with_rstd, quant=quant,
                                               use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                                               use_packed_ue8m0=packed)
    for got in (first, second):
        _assert_same_outputs(got, (o, sf, rstd))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 4001])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("offset", [0, 1])
def test_norm_backward_native_equals_python_launch_path(native, monkeypatch, t, weight, offset):
    """The public norm_backward on the native plan equals the Python launch path bitwise (x_grad and the
    assigned weight_grad); misaligned inputs too."""
    from tilefuse.quant import _norm_kernel as KN, norm as N

    h = 7168
    x = torch.randn(t, h + 64, device="cuda").to(torch.bfloat16)[:, offset:offset + h]
    dy = torch.randn(t, h + 32, device="cuda").to(torch.bfloat16)[:, offset:offset + h]
    w = torch.randn(h + 8, device="cuda").to(torch.bfloat16)[offset:offset + h] if weight else None
    rstd = torch.rand(t, device="cuda") + 0.5
    first, second = N.norm_backward(dy, x, w, rstd, out_scale=0.75), N.norm_backward(dy, x, w, rstd, out_scale=0.75)
    assert any(type(p).__module__ == "tilefuse_native" for p in KN._PLANS.values())
    monkeypatch.setattr(KN, "_backward_plan", lambda *a: None)
    want = KN.norm_backward_launch(dy, x, w, rstd, None, 0.75)
    for got in (first, second):
        _assert_same_outputs(got, want)


@pytest.mark.gpu
def test_norm_native_outputs_take_record_stream(native):
    """The RMSNorm plan's outputs are caching-allocator tensors: record_stream holds a freed block for a busy side
    stream."""
    from tilefuse.quant import _norm_kernel as KN, norm as N

    x = torch.randn(64, 7168, device="cuda").to(torch.bfloat16)
    w = torch.randn(7168, device="cuda").to(torch.bfloat16)
    out = N.norm_forward(x, w, 1e-6)[0]
    assert any(type(p).__module__ == "tilefuse_native" for p in KN._PLANS.values())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        seen = out.clone()
    out.record_stream(side)
    ptr, nbytes = out.data_ptr(), out.numel() * out.element_size()
    del out
    again = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    assert again.data_ptr() != ptr
    torch.cuda.synchronize()
    assert torch.equal(seen, N.norm_forward(x, w, 1e-6)[0])   # the side stream read the data the kernel wrote
