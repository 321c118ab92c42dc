"""benchmarks/bench_forcefield.py on the CPU: the --quick run end to end (every requested cell is a
number or says why not, the JSON has its keys), the hand-written static-pair peer against the
reference models it stands in for, the water-like boxes' density and the memory refusal."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_forcefield as bench  # noqa: E402  (puts examples/ on sys.path)
from forcefield.models import PaiNN, SchNet  # noqa: E402

JSON_KEYS = {"device", "command", "argv", "config", "systems", "rows", "md", "targets", "notes", "reports"}
ROW_STATES = ("ok", "n/a:", "unavailable:", "error:")


# The op each fused model needs beyond neighbor_list and radial_basis.
MESSAGE_OP = {"schnet": "message_passing", "painn": "vector_message_passing"}


def mirage_ready(model_name):
    """Whether mirage's fused model of this kind can run here (its message-passing op is built)."""
    try:
        import mirage  # noqa: F401  (registers torch.ops.mirage)
    except ImportError:
        return False
    return hasattr(torch.ops.mirage, MESSAGE_OP[model_name])


def small_model(cls, dtype=torch.float64):
    torch.manual_seed(0)
    return cls(hidden=16, num_interactions=2, num_rbf=8, cutoff=5.0).to(dtype).eval()


def reference_energy_forces(model, system):
    return bench.energy_and_forces(lambda p: model(system["z"], p, system["cell64"], system["pbc"]), system["pos64"])


@pytest.mark.parametrize("cls", [SchNet, PaiNN])
@pytest.mark.parametrize("name", ["benzene", "box3k"])
@pytest.mark.parametrize("pairs_from", ["radius_graph", "neighbor_list"])
def test_static_pair_energy_is_the_reference_model(cls, name, pairs_from):
    """The eager+graph peer's forward with a fixed pair list gives the reference model's energy and
    forces (float64), with the pairs from radius_graph or from mirage.ops.neighbor_list."""
    if pairs_from == "neighbor_list":
        pytest.importorskip("mirage")
    system = bench.make_system(name, quick=True, device=torch.device("cpu"))
    # Move the atoms off the lattice a little so that the test sees fresh geometry every run.
    system["pos64"] = system["pos64"] + 0.05 * torch.randn_like(system["pos64"])
    system["pos"] = system["pos64"].float()
    model = small_model(cls)
    # The pairs from float64 positions and cell, as the reference finds its own: from float32 ones
    # a pair within ~1e-7 A of the cutoff could be left out, and SchNet's basis does not vanish there.
    exact = dict(system, pos=system["pos64"], cell=system["cell64"])
    i, j, shift = bench.reference_pairs(exact) if pairs_from == "radius_graph" else bench.pair_list(exact)
    assert shift.dtype == torch.float64 and i.shape[0] > 0
    energy, forces = bench.energy_and_forces(
        lambda p: bench.static_pair_energy(model, system["z"], p, i, j, shift), system["pos64"])
    ref_energy, ref_forces = reference_energy_forces(model, system)
    assert forces.abs().max() > 1e-3  # a real force field, not a constant
    torch.testing.assert_close(energy, ref_energy, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(forces, ref_forces, rtol=1e-9, atol=1e-10)


def test_static_pair_energy_refuses_an_unknown_model():
    with pytest.raises(TypeError, match="atom_energies: no pair-list forward for Linear"):
        pair = torch.tensor([1])
        bench.static_pair_energy(torch.nn.Linear(3, 1), None, torch.zeros(2, 3), pair, pair - 1, torch.zeros(1, 3))


def test_water_box_is_liquid_like():
    """~43 neighbours within 5 A per atom (the issue's ~130k pairs for 3,000 atoms), wrapped into
    the cell, O-H bonds of the water geometry."""
    per_side = 4
    numbers, positions, cell = bench.water_box(per_side, seed=int(torch.randint(0, 2**31, ())))
    n = 3 * per_side**3
    assert numbers.shape == (n,) and positions.shape == (n, 3)
    assert set(numbers.tolist()) == {1, 8}
    length = per_side * bench.SPACING
    assert torch.equal(cell, torch.eye(3, dtype=torch.float64) * length)
    assert (positions >= 0).all() and (positions < length).all()
    i, _, vec = bench.radius_graph(positions, 5.0, cell, torch.ones(3, dtype=torch.bool))
    assert 37 < i.shape[0] / n < 50
    # Each H sits 0.9572 A from its own O (the O of its molecule, maybe across a face).
    o, h1 = positions[0::3], positions[1::3]
    delta = h1 - o
    delta -= torch.round(delta / length) * length
    torch.testing.assert_close(delta.norm(dim=-1), torch.full((n // 3,), bench.OH_BOND, dtype=torch.float64))


def test_the_reference_radius_graph_is_refused_where_it_cannot_fit():
    """100k atoms: the [27, N, N] distance tensors would take terabytes; eager and compile report
    n/a with the size instead of trying."""
    need = bench.radius_graph_bytes(98_304, True, torch.float32)
    assert need > 5e12
    assert 4e9 < bench.radius_graph_bytes(3000, True, torch.float32) < 6e9
    system = bench.make_system("box100k", quick=False, device=torch.device("cpu"))
    assert system["z"].shape[0] == 98_304
    model = small_model(SchNet, torch.float32)
    for peer in ("eager", "compile", "compile-ro"):
        with pytest.raises(bench.Skip, match=r"needs 5\.\d+ TB for radius_graph's \[27, N, N\] tensors"):
            bench.build_peer(peer, model, system, [], "schnet on box100k")


@pytest.mark.parametrize("name", ["schnet", "painn"])
def test_md_weights_take_the_trained_student_on_benzene(name):
    from forcefield.train_student import STUDENT_PATHS, load_student

    benzene = bench.make_system("benzene", False, torch.device("cpu"))
    cls = bench.MODELS[name]
    model = cls(**bench.MODEL_CONFIG).eval()
    trained, label = bench.md_weights(name, model, benzene)
    assert label == "trained student" and trained is not model
    student, _ = load_student(STUDENT_PATHS[name])
    for key, value in student.state_dict().items():
        assert torch.equal(trained.state_dict()[key], value), key
    if name == "painn":  # a setting outside the state_dict comes with the student
        assert {u.norm_eps for u in trained.updates} == {u.norm_eps for u in student.updates} == {1e-2}
    small = cls(**bench.QUICK_MODEL_CONFIG).eval()
    assert bench.md_weights(name, small, benzene) == (small, "random (the student has another size)")
    box = bench.make_system("box3k", True, torch.device("cpu"))
    assert bench.md_weights(name, model, box) == (model, "random")


def test_command_line_errors():
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--peers", "eager,nonsense"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--systems", "water"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.main(["--systems", "benzene"])


def test_quick_run_in_bf16_mixed(tmp_path, one_thread):
    """--precision bf16-mixed reaches every peer: their forces carry bfloat16's error (about
    5e-3 of the RMS force here; float32's is about 2e-7, and the fp32 run below holds it under
    1e-4), but for mirage on the GPU, whose whole-model ops stay float32. The reference SchNet
    as written mixes dtypes in index_add_ under autocast, which its eager row reports."""
    out = tmp_path / "ff.json"
    assert bench.main(["--quick", "--peers", "eager,mirage", "--systems", "benzene", "--no-md",
                       "--precision", "bf16-mixed", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["precision"] == "bf16-mixed"
    for row in result["rows"]:
        if row["peer"] == "eager" and row["model"] == "schnet":
            assert row["status"].startswith("error: RuntimeError: index_add_()"), row
        elif row["peer"] == "mirage" and torch.cuda.is_available():
            # On the GPU benzene runs as the float32 whole-model op, under autocast too.
            assert row["status"] == "ok", row
            assert row["f_rel_rms_err"] < 1e-4, row
        elif row["peer"] == "eager" or mirage_ready(row["model"]):
            assert row["status"] == "ok", row
            assert 1e-3 < row["f_rel_rms_err"] < 0.05, row
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--precision", "fp16"])
    from mirage.ff.precision import PRECISIONS  # the bench keeps a copy (it imports mirage only where needed)

    assert bench.PRECISIONS == PRECISIONS


def test_quick_run(tmp_path, capsys, one_thread):
    """--quick on the CPU: every (model, system, peer) has a row that is timed with a small force
    error or says why not; the mirage columns run once mirage's ops are there."""
    out = tmp_path / "ff.json"
    peers = ["eager", "eager+graph", "mirage"]
    systems = ["benzene", "box3k"]
    assert bench.main(["--quick", "--peers", ",".join(peers), "--systems", ",".join(systems),
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert JSON_KEYS <= set(result)
    assert "bench_forcefield.py --quick" in result["command"]
    assert result["systems"]["benzene"]["atoms"] == 12 and result["systems"]["benzene"]["pairs"] == 132
    assert result["systems"]["box3k"]["atoms"] == 24 and result["systems"]["box3k"]["periodic"]
    assert result["systems"]["box3k"]["pairs"] > 24 * 20
    cells = {(r["model"], r["system"], r["peer"]): r for r in result["rows"]}
    assert set(cells) == {(m, s, p) for m in bench.MODELS for s in systems for p in peers}
    for (model, system, peer), row in cells.items():
        assert row["status"].startswith(ROW_STATES), row
        if peer == "eager" or (peer == "mirage" and mirage_ready(model)):
            assert row["status"] == "ok", row
            assert row["ms"] > 0 and row["first_s"] >= 0
            # float32 against float64: a few ulps of the forces, not a different model.
            assert row["f_rel_rms_err"] < 1e-4, row
            assert row["f_max_err"] < 1e-3, row
        elif peer == "eager+graph":
            if torch.cuda.is_available():
                assert row["status"] == "ok", row
            else:
                assert row["status"] == "n/a: needs CUDA (a CUDA graph)"
        else:
            # Printed with its reason, never silent: an import error or optimize's refusal.
            assert row["status"] != "ok" and len(row["status"].split(":", 1)[1].strip()) > 10
            assert f"{model} {system} mirage: {row['status']}" in printed
        if row["status"] == "ok":
            assert row["vs_best_peer"] is not None
    md = {(r["model"], r["system"], r["driver"]): r for r in result["md"]}
    assert set(md) == {(m, s, d) for m in bench.MODELS for s in systems
                       for d in ("mirage md K=2", "ase+calculator")}
    try:
        import ase  # noqa: F401
        have_ase = True
    except ImportError:
        have_ase = False
    for row in md.values():
        if mirage_ready(row["model"]) and have_ase:
            assert row["status"] == "ok", row
            assert row["steps_per_s"] > 0 and row["ns_per_day"] == pytest.approx(row["steps_per_s"] * 0.0432)
        else:
            assert row["status"].startswith(("n/a:", "unavailable:")), row
    names = [t["name"] for t in result["targets"]]
    assert "schnet benzene: mirage ms per energy+forces (call)" in names
    assert "Issue 4 targets:" in printed


# Kernels of mirage's fused force fields as torch.profiler named them on an H200 (2026-11-28,
# profile_forcefield.py --models painn|schnet --systems box3k), with the category each belongs to.
PROFILED_KERNELS = [
    ("void mirage::cuda::(anonymous namespace)::backward_kernel<float, 4, true>(mirage::cuda::"
     "VectorMessagePassingBackwardParams, int, int const*, float*, float*, float*, int*)", "mirage message passing"),
    ("void mirage::cuda::(anonymous namespace)::forward_kernel<float, 4, true>(mirage::cuda::"
     "VectorMessagePassingParams, int, float*, float*, int*)", "mirage message passing"),
    ("mirage::cuda::(anonymous namespace)::filter_table_kernel(mirage::cuda::FilterTableParams)",
     "mirage message passing"),
    ("void mirage::cuda::(anonymous namespace)::radial_cfconv_kernel<true>(mirage::cuda::RadialCfconvParams, int "
     "const*)", "mirage message passing"),
    ("void mirage::cuda::(anonymous namespace)::narrow_linear_kernel<3>(mirage::cuda::NarrowLinearParams)",
     "gemm (cuBLAS, mirage::linear)"),
    ("void mirage::cuda::(anonymous namespace)::tiled_linear_kernel<32, true, true>(mirage::cuda::TiledLinearParams)",
     "gemm (cuBLAS, mirage::linear)"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma_aligna4_alignc4_execute_kernel",
     "gemm (cuBLAS, mirage::linear)"),
    ("void mirage::cuda::(anonymous namespace)::update_backward_kernel<float>(mirage::cuda::PainnUpdateBackwardParams)",
     "mirage painn update"),
    ("void mirage::cuda::(anonymous namespace)::radial_basis_backward_kernel<float, 4>(mirage::cuda::"
     "RadialBasisBackwardParams)", "mirage radial basis"),
    ("mirage::cuda::(anonymous namespace)::cell_list_write_kernel(mirage::cuda::NeighborListParams)",
     "mirage neighbor list"),
    ("mirage::cuda::(anonymous namespace)::scatter_pairs_kernel(long const*, int, int, long const*, int const*, int*)",
     "mirage sender order, pair vectors"),
    ("mirage::cuda::(anonymous namespace)::pair_vectors_backward_kernel(mirage::cuda::PairVectorsBackwardParams, int)",
     "mirage sender order, pair vectors"),
    ("void mirage::cuda::finish_kernel<float>(mirage::cuda::Segments, int const*, mirage::cuda::OrderCheck)",
     "mirage finish passes"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >",
     "other elementwise"),
]


@pytest.mark.parametrize("name,expected", PROFILED_KERNELS)
def test_profile_categories(name, expected):
    """profile_forcefield.py puts each of mirage's kernels in its own category: PaiNN's message
    passing, named after its params, once fell in "other elementwise" (82% of PaiNN's time)."""
    import profile_forcefield

    assert profile_forcefield.category(name) == expected


def test_profile_md_timeline_runs(capsys):
    """profile_forcefield.py --md on the CPU: the replay runs and is reported (no device events there)."""
    import profile_forcefield

    profile_forcefield.md_timeline("schnet", steps=2, device="cpu")
    out = capsys.readouterr().out
    assert "schnet benzene (trained student weights), mirage.ff.md, one replay of 2 steps: 0 device events" in out
