"""The layer-norm planner (fluxpy.kernels.layernorm_plan), without CuPy: the plans match those the planner chose
before it moved out of cuda_layernorm.py (a recorded table, and a digest over a grid of lengths), and every plan
keeps the invariants the kernels rely on (threads a block, shared memory, ptxas's register cap, the row covered)."""
import hashlib

import numpy as np
import pytest

from fluxpy.kernels import cuda_layernorm, layernorm_plan as lp
from fluxpy.kernels.halfs import BFLOAT16

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32),
          "float64": np.dtype(np.float64)}


def _forward_text(length, dtype, fused):
    p = lp.forward_plan(length, dtype, fused)
    return None if p is None else (f"{p.vw}/{p.tpr}/{p.rpb}/{p.items} b{p.blocks} pf{int(p.prefetch)} "
                                   f"st{p.stages}")


def _backward_text(length, dtype, fused):
    p = lp.backward_plan(length, dtype, fused)
    return None if p is None else (f"{p.kernel} {p.vw}/{p.tpr}/{p.rpb}/{p.items} pf{int(p.prefetch)} "
                                   f"c{p.cluster} b{p.blocks}")


# (length, dtype, fused, forward "vw/tpr/rpb/items blocks prefetch stages", backward "kernel vw/tpr/rpb/items
# prefetch cluster blocks"), recorded from the planner as it was inside cuda_layernorm.py (sm_90's limits).
RECORDED = [
    (2, 'float16', False, '2/32/4/1 b1 pf1 st0', 'ln_bwd1 2/32/8/1 pf1 c1 b1'),
    (2, 'float16', True, '2/32/4/1 b1 pf1 st0', 'ln_bwd1 2/32/8/1 pf1 c1 b1'),
    (3, 'float32', False, '1/32/4/1 b1 pf1 st0', 'ln_bwd1 1/32/8/1 pf1 c1 b1'),
    (3, 'float32', True, '1/32/4/1 b1 pf1 st0', 'ln_bwd1 1/32/8/1 pf1 c1 b1'),
    (7, 'float64', False, '1/32/4/1 b1 pf0 st0', 'ln_bwd1 1/32/8/1 pf1 c1 b1'),
    (7, 'float64', True, '1/32/4/1 b1 pf0 st0', 'ln_bwd1 1/32/8/1 pf1 c1 b1'),
    (64, 'bfloat16', False, '4/32/4/1 b1 pf1 st0', 'ln_bwd1 4/32/8/1 pf1 c1 b1'),
    (64, 'bfloat16', True, '4/32/4/1 b1 pf1 st0', 'ln_bwd1 4/32/8/1 pf1 c1 b1'),
    (512, 'float16', False, '4/32/4/4 b1 pf1 st0', 'ln_bwd1 4/64/4/2 pf1 c1 b1'),
    (512, 'float16', True, '4/32/4/4 b1 pf1 st0', 'ln_bwd1 4/64/4/2 pf1 c1 b1'),
    (640, 'float32', False, '4/32/4/5 b1 pf1 st0', 'ln_bwd1 4/64/4/3 pf1 c1 b1'),
    (640, 'float32', True, '4/32/4/5 b1 pf1 st0', 'ln_bwd1 4/64/4/3 pf1 c1 b1'),
    (768, 'float16', False, '4/64/2/3 b1 pf1 st0', 'ln_bwd1 4/64/4/3 pf1 c1 b1'),
    (768, 'float16', True, '4/64/2/3 b1 pf1 st0', 'ln_bwd1 4/64/4/3 pf1 c1 b1'),
    (768, 'float32', False, '4/64/2/3 b1 pf1 st0', 'ln_bwd1 4/64/4/3 pf1 c1 b1'),
    (768, 'float32', True, '4/64/2/3 b1 pf1 st0', 'ln_bwd1 4/64/4/3 pf1 c1 b1'),
    (768, 'float64', False, '2/128/1/3 b1 pf0 st0', 'ln_bwd1 2/96/4/4 pf1 c1 b1'),
    (768, 'float64', True, '2/128/1/3 b1 pf0 st0', 'ln_bwd1 2/96/4/4 pf1 c1 b1'),
    (1000, 'float32', False, '4/64/2/4 b1 pf1 st0', 'ln_bwd1 4/64/4/4 pf1 c1 b1'),
    (1000, 'float32', True, '4/64/2/4 b1 pf1 st0', 'ln_bwd1 4/64/4/4 pf1 c1 b1'),
    (1280, 'bfloat16', False, '4/64/2/5 b1 pf1 st0', 'ln_bwd1 4/96/5/4 pf1 c1 b1'),
    (1280, 'bfloat16', True, '4/64/2/5 b1 pf1 st0', 'ln_bwd1 4/96/5/4 pf1 c1 b1'),
    (1536, 'float16', False, '4/128/1/3 b1 pf1 st0', 'ln_bwd1 4/96/5/4 pf1 c1 b1'),
    (1536, 'float16', True, '4/128/1/3 b1 pf1 st0', 'ln_bwd1 4/96/5/4 pf1 c1 b1'),
    (2304, 'float16', False, '4/128/1/5 b1 pf0 st0', 'ln_bwd1 4/160/3/4 pf1 c1 b1'),
    (2304, 'float16', True, '4/128/1/5 b1 pf0 st0', 'ln_bwd1 4/160/3/4 pf1 c1 b1'),
    (4096, 'float32', False, '4/256/1/4 b1 pf0 st0', 'ln_bwd1 4/256/1/4 pf1 c1 b1'),
    (4096, 'float32', True, '4/256/1/4 b1 pf0 st0', 'ln_bwd1 4/256/1/4 pf1 c1 b1'),
    (4608, 'float16', False, '4/256/1/5 b1 pf0 st0', 'ln_bwd1 4/288/1/4 pf1 c1 b1'),
    (4608, 'float16', True, '4/256/1/5 b1 pf0 st0', 'ln_bwd1 4/288/1/4 pf1 c1 b1'),
    (5140, 'float16', False, '4/256/1/6 b1 pf0 st0', 'ln_bwd1 4/352/1/4 pf1 c1 b1'),
    (5140, 'float16', True, '4/256/1/6 b1 pf0 st0', 'ln_bwd1 4/352/1/4 pf1 c1 b1'),
    (5140, 'float32', False, '4/256/1/6 b1 pf0 st0', 'ln_bwd1 4/352/1/4 pf1 c1 b1'),
    (5140, 'float32', True, '4/256/1/6 b1 pf0 st0', 'ln_bwd1 4/352/1/4 pf1 c1 b1'),
    (6144, 'bfloat16', False, '4/256/1/6 b1 pf0 st0', 'ln_bwd1 4/384/1/4 pf1 c1 b1'),
    (6144, 'bfloat16', True, '4/256/1/6 b1 pf0 st0', 'ln_bwd1 4/384/1/4 pf1 c1 b1'),
    (8448, 'float16', False, '4/288/1/8 b4 pf0 st0', 'ln_bwds 4/288/1/8 pf1 c1 b1'),
    (8448, 'float16', True, '4/512/1/5 b1 pf0 st0', 'ln_bwds 4/288/1/8 pf0 c1 b1'),
    (9728, 'float32', False, '4/512/1/5 b1 pf0 st0', 'ln_bwds 4/320/1/8 pf0 c1 b1'),
    (9728, 'float32', True, '4/512/1/5 b1 pf0 st0', 'ln_bwds 4/352/1/7 pf0 c1 b1'),
    (10236, 'float32', False, '4/512/1/5 b1 pf0 st0', 'ln_bwds 4/320/1/8 pf0 c1 b1'),
    (10236, 'float32', True, '4/512/1/5 b1 pf0 st0', 'ln_bwds 4/384/1/7 pf0 c1 b1'),
    (10236, 'float64', False, '2/1024/1/5 b1 pf0 st0', 'ln_dx2 2/1024/1/5 pf0 c1 b1'),
    (10236, 'float64', True, '2/1024/1/5 b1 pf0 st0', 'ln_dx2 2/1024/1/5 pf0 c1 b1'),
    (10240, 'float16', False, '4/256/1/10 b4 pf0 st0', 'ln_bwds 4/320/1/8 pf1 c1 b1'),
    (10240, 'float16', True, '4/512/1/5 b1 pf0 st0', 'ln_bwds 4/320/1/8 pf0 c1 b1'),
    (12288, 'float16', False, '4/384/1/8 b3 pf0 st0', 'ln_bwds 4/384/1/8 pf1 c1 b1'),
    (12288, 'float16', True, '4/512/1/6 b1 pf0 st0', 'ln_bwds 4/384/1/8 pf0 c1 b1'),
    (12288, 'float32', False, '4/512/1/6 b1 pf0 st0', 'ln_bwds 4/384/1/8 pf0 c1 b1'),
    (12288, 'float32', True, '4/512/1/6 b1 pf0 st0', 'ln_bwdc 4/192/1/8 pf0 c2 b1'),
    (12288, 'float64', False, '2/1024/1/6 b1 pf0 st0', 'ln_dx2 2/1024/1/6 pf0 c1 b1'),
    (12288, 'float64', True, '2/1024/1/6 b1 pf0 st0', 'ln_dx2 2/1024/1/6 pf0 c1 b1'),
    (12800, 'float64', False, '2/1024/1/7 b1 pf0 st0', 'ln_dx2 2/1024/1/7 pf0 c1 b1'),
    (12800, 'float64', True, '2/1024/1/7 b1 pf0 st0', 'ln_dx2 2/1024/1/7 pf0 c1 b1'),
    (14340, 'float16', False, '4/512/1/8 b1 pf0 st0', 'ln_bwds 4/480/1/8 pf0 c1 b1'),
    (14340, 'float16', True, '4/512/1/8 b1 pf0 st0', 'ln_bwdr 4/480/1/8 pf0 c1 b1'),
    (16380, 'float32', False, '4/512/1/8 b1 pf0 st0', 'ln_bwdr 4/512/1/8 pf0 c1 b1'),
    (16380, 'float32', True, '4/512/1/8 b1 pf0 st0', 'ln_bwdr 4/512/1/8 pf0 c1 b1'),
    (16384, 'float16', False, '4/512/1/8 b1 pf0 st0', 'ln_bwds 4/512/1/8 pf0 c1 b1'),
    (16384, 'float16', True, '4/512/1/8 b1 pf0 st0', 'ln_bwdc 4/128/1/8 pf0 c4 b3'),
    (16384, 'float64', False, '2/1024/1/8 b1 pf0 st0', 'ln_dx2 2/1024/1/8 pf0 c1 b1'),
    (16384, 'float64', True, '2/1024/1/8 b1 pf0 st0', 'ln_dx2 2/1024/1/8 pf0 c1 b1'),
    (16388, 'float16', False, '4/544/1/8 b2 pf0 st0', 'ln_bwdr 4/544/1/8 pf0 c1 b1'),
    (16388, 'float16', True, '4/1024/1/5 b1 pf0 st1', 'ln_bwdr 4/608/1/7 pf0 c1 b1'),
    (16896, 'bfloat16', False, '4/544/1/8 b2 pf0 st0', 'ln_bwdc 4/160/1/7 pf0 c4 b3'),
    (16896, 'bfloat16', True, '4/1024/1/5 b1 pf0 st1', 'ln_bwdc 4/160/1/7 pf0 c4 b3'),
    (18432, 'float16', False, '4/576/1/8 b2 pf0 st0', 'ln_bwdc 4/160/1/8 pf0 c4 b3'),
    (18432, 'float16', True, '4/1024/1/5 b1 pf0 st1', 'ln_bwdc 4/96/1/6 pf0 c8 b4'),
    (20476, 'float16', False, '4/512/1/10 b2 pf0 st0', 'ln_bwdr 4/640/1/8 pf0 c1 b1'),
    (20476, 'float16', True, '4/1024/1/5 b1 pf0 st1', 'ln_dx1 4/640/1/8 pf0 c1 b1'),
    (20480, 'float16', False, '4/512/1/10 b2 pf0 st0', 'ln_bwdc 4/160/1/8 pf0 c4 b3'),
    (20480, 'float16', True, '4/1024/1/5 b1 pf0 st1', 'ln_bwdc 4/96/1/7 pf0 c8 b4'),
    (20480, 'bfloat16', False, '4/512/1/10 b2 pf0 st0', 'ln_bwdc 4/160/1/8 pf0 c4 b3'),
    (20480, 'bfloat16', True, '4/1024/1/5 b1 pf0 st1', 'ln_bwdc 4/96/1/7 pf0 c8 b4'),
    (20480, 'float32', False, '4/1024/1/5 b1 pf0 st1', 'ln_bwdc 4/320/1/8 pf0 c2 b1'),
    (20480, 'float32', True, '4/1024/1/5 b1 pf0 st1', 'ln_bwdc 4/384/1/7 pf0 c2 b1'),
    (20480, 'float64', False, None, None),
    (20480, 'float64', True, None, None),
    (20484, 'float16', False, '4/448/1/12 b2 pf0 st0', 'ln_dx1 4/672/1/8 pf0 c1 b1'),
    (20484, 'float16', True, '4/1024/1/6 b1 pf0 st1', 'ln_dx1 4/672/1/8 pf0 c1 b1'),
    (20484, 'float32', False, '4/1024/1/6 b1 pf0 st1', 'ln_dx2 4/1024/1/6 pf0 c1 b1'),
    (20484, 'float32', True, '4/1024/1/6 b1 pf0 st1', 'ln_dx2 4/1024/1/6 pf0 c1 b1'),
    (24576, 'float16', False, '4/1024/1/6 b1 pf1 st0', 'ln_bwdc 4/192/1/8 pf0 c4 b2'),
    (24576, 'float16', True, '4/1024/1/6 b1 pf0 st1', 'ln_bwdc 4/192/1/8 pf0 c4 b2'),
    (24576, 'float32', False, '4/1024/1/6 b1 pf0 st1', 'ln_bwdc 4/384/1/8 pf0 c2 b1'),
    (24576, 'float32', True, '4/1024/1/6 b1 pf0 st1', 'ln_bwdc 4/192/1/8 pf0 c4 b1'),
    (26624, 'bfloat16', False, '4/1024/1/7 b1 pf0 st1', 'ln_bwdc 4/128/1/7 pf0 c8 b4'),
    (26624, 'bfloat16', True, '4/1024/1/7 b1 pf0 st1', 'ln_bwdc 4/128/1/7 pf0 c8 b4'),
    (28672, 'float16', False, '4/1024/1/7 b1 pf0 st1', 'ln_bwdc 4/128/1/7 pf0 c8 b4'),
    (28672, 'float16', True, '4/1024/1/7 b1 pf0 st1', 'ln_bwdc 4/128/1/7 pf0 c8 b4'),
    (32764, 'float16', False, '4/1024/1/8 b1 pf0 st1', 'ln_dx2 4/1024/1/8 pf0 c1 b1'),
    (32764, 'float16', True, '4/1024/1/8 b1 pf0 st1', 'ln_dx2 4/1024/1/8 pf0 c1 b1'),
    (32768, 'float16', False, '4/1024/1/8 b1 pf0 st1', 'ln_bwdc 4/256/1/8 pf0 c4 b2'),
    (32768, 'float16', True, '4/1024/1/8 b1 pf0 st1', 'ln_bwdc 4/128/1/8 pf0 c8 b3'),
    (32768, 'float32', False, '4/1024/1/8 b1 pf0 st1', 'ln_bwdc 4/256/1/8 pf0 c4 b1'),
    (32768, 'float32', True, '4/1024/1/8 b1 pf0 st0', 'ln_bwdc 4/256/1/8 pf0 c4 b1'),
]


@pytest.mark.parametrize("length,dtype,fused,forward,backward", RECORDED, ids=str)
def test_plans_match_the_recorded_ones(length, dtype, fused, forward, backward):
    assert _forward_text(length, DTYPES[dtype], fused) == forward
    assert _backward_text(length, DTYPES[dtype], fused) == backward


def _grid():
    return list(range(2, 32769, 37)) + list(range(16380, 16400)) + list(range(20470, 20490))


def test_plans_over_a_grid_match_the_recorded_digest():
    """Every 37th length from 2 to 32,768 and two runs of lengths about the ln_bwds/ln_bwdc/ln_bwdr boundaries, each
    dtype, plain and fused: the same plans as recorded (a digest of their text)."""
    h = hashlib.sha256()
    for name, dtype in DTYPES.items():
        for length in _grid():
            for fused in (False, True):
                h.update(repr((length, name, fused, _forward_text(length, dtype, fused),
                               _backward_text(length, dtype, fused))).encode())
    assert h.hexdigest() == "95755c6134226836a4d739c919631af0ee27ca88258c07fd76cbc2b7afddad57"


def _random_lengths(seed, n=400):
    rng = np.random.default_rng(seed)
    return sorted(set(rng.integers(2, 32769, n).tolist()) | {2, 3, 4, 32768, 16384, 16388, 20484})


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_plan_keeps_the_invariants(name):
    dtype = DTYPES[name]
    limit = lp.SM90_SHARED_BYTES
    for length in _random_lengths(sum(map(ord, name))):
        for fused in (False, True):
            f, b = lp.forward_plan(length, dtype, fused), lp.backward_plan(length, dtype, fused)
            if f is None:   # the op turns the rows down (the composite runs): no backward is asked for
                assert lp.row_shape(length, dtype) is None
                continue
            assert b is not None, "a backward for every row the forward takes"
            what = f"{length} {name} fused={fused}"
            for p in (f, b):
                assert p.tpr % 32 == 0 and 32 <= p.threads <= 1024, (what, p)
                assert length % p.vw == 0, (what, p)
            assert f.tpr * f.items * f.vw >= length > f.tpr * (f.items - 1) * f.vw, (what, f)
            assert f.stages * lp.staged_bytes(length, dtype, fused) <= limit - 1024
            assert not (f.prefetch and f.stages), "registers or shared memory, not both"
            share = length // b.cluster
            assert b.tpr * b.items * b.vw >= share, (what, b)
            nbytes = lp.backward_shared_bytes(b, length, dtype, fused)
            assert b.blocks * (nbytes + 1024) <= limit + 1024, (what, b)
            if b.kernel in ("ln_bwd1", "ln_dx1"):
                regs = lp._one_sweep_registers(dtype, b.vw, b.items, b.prefetch, b.kernel == "ln_bwd1")
                assert regs <= lp.register_cap(b.tpr), (what, b, regs)
            if b.kernel in ("ln_bwds", "ln_bwdc"):
                regs = lp._shared_sweep_registers(dtype, b.vw, b.items, fused)
                assert regs <= lp.register_cap(b.blocks * b.tpr), (what, b, regs)
            assert b.kernel != "ln_bwdc" or b.cluster in (2, 4, 8) and length % (b.cluster * b.vw) == 0
            assert b.blocks == 1 or b.kernel == "ln_bwdc", "two-block forms are ptxas's to choose, not the plan's"


def test_limits_shape_the_plans():
    """Without clusters no ln_bwdc; with 48 KB of shared memory a block no ln_bwds and no staged forward."""
    no_clusters, small = lp.Limits(clusters=False), lp.Limits(shared_per_block=48 * 1024)
    for length in (18432, 20480, 32768):
        assert lp.backward_plan(length, np.float16, False, no_clusters).kernel in ("ln_dx1", "ln_dx2", "ln_bwdr")
    assert lp.backward_plan(12288, np.float16, False, small).kernel != "ln_bwds"
    assert lp.forward_plan(32768, np.float32, False, small).stages == 0
    assert lp.forward_plan(32768, np.float32).stages == 1


def test_two_block_and_forward_forms():
    plan = lp.backward_plan(5140, np.float16)
    forms = lp.two_block_forms(plan, 5140)
    assert forms and all(f.blocks == 2 and f.rpb == 1 and f.items > plan.items for f in forms)
    assert [f.tpr for f in forms] == sorted({f.tpr for f in forms}, reverse=True)
    fwd = lp.forward_plan(12288, np.float16)
    forms = lp.forward_forms(fwd, 12288, np.float16)
    assert [f.blocks for f in forms] == list(range(fwd.blocks, 0, -1))


@pytest.mark.parametrize("rows", [1, 300, 8192, 100_000])
def test_column_plans(rows):
    for length in (2, 768, 20484, 32768):
        c = lp.column_plan(length, np.float16, rows)
        assert c.chunk % lp.COLUMN_WARPS == 0 and c.chunk >= lp.COLUMN_MIN_ROWS
        assert c.chunks * c.chunk >= rows > (c.chunks - 1) * c.chunk
        assert 32 * c.tiles * c.kvw >= length


def test_tuning_switches_change_the_plan(monkeypatch):
    """The switches tests and benchmarks turn: SPLIT_FROM sends ln_bwd's rows to the split backward."""
    monkeypatch.setitem(lp.SHARED_COLUMNS, 2, False)
    assert lp.backward_plan(10240, np.float16).kernel == "ln_bwd"
    before = lp.tuning(np.float16)
    monkeypatch.setitem(lp.SPLIT_FROM, 2, 10240)
    assert lp.backward_plan(10240, np.float16).kernel in ("ln_dx1", "ln_dx2")
    assert lp.tuning(np.float16) != before


def test_source_variants_name_files_and_defines_the_sources_read():
    variants = list(cuda_layernorm.SOURCE_VARIANTS())
    names = {name for name, _ in variants}
    assert names == {"layernorm_forward.cu", "layernorm_backward.cu", "layernorm_two_sweep.cu",
                     "layernorm_cluster.cu", "layernorm_params.cu"}
    for name in names:
        assert "__global__" in cuda_layernorm.compiler.source(name)
    assert 100 < len(variants) < 600
    kernels = {d.get("SUMS") for n, d in variants if n == "layernorm_backward.cu"}
    assert kernels == {0, 1, 2}, "ln_dx1, ln_bwd1 and ln_bwds/ln_bwdr all sampled"
    for _, defines in variants:
        assert all(isinstance(v, (int, str)) for v in defines.values())
        assert "FX_DTYPE" in defines and "L" in defines
