"""Expert parallelism: MoE models with experts split over ep ranks train as one process does.

One spawn of world 4 runs every case (ep_workloads.CASES), each on a mesh of its own: (shard 2 x
ep 2) at stages 1, 2 (with frozen experts) and 3, ep 4 at stage 3, for zeroshard's GPT with MoE,
HF Mixtral (also with the config's load-balancing loss) and HF Qwen2-MoE, and ep with tp ((shard 2
x tp 2) with ep 2 at stages 1 and 3, GPT and Mixtral, Qwen2-MoE at 3; ep 4 at stage 3 with tokens tp does not
divide); accumulation 2 (and 1 and 4 once each) and clipping on. Every case is held against plain
single-process PyTorch over 10 steps, and its all-to-all bytes against its own routing counts. The
same spawn trains OLMoE, DeepSeek-V3 and GPT-OSS save_pretrained folders at (shard 2 x ep 2), their
MoE layers found by the plan transformers declares (moe_family_workloads.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import ep_workloads as ew  # noqa: E402
import moe_family_workloads as mw  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # the first test carries the group's spawn (slow on a loaded machine)

TOL = 1e-5
NAMES = list(ew.CASES)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return ew.make_folder(tmp_path_factory.mktemp("ep"))


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, str]:
    return mw.make_folders(tmp_path_factory.mktemp("moe-families"))


@pytest.fixture(scope="module")
def world4(folder, families) -> dict:
    return spawn(ew.suite, 4, args=(tuple(ew.CASES), folder, families), timeout_s=600)[0]


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: ew.reference(case) for name, case in ew.CASES.items()}


@pytest.mark.parametrize("name", NAMES)
def test_matches_one_process(world4, references, name):
    got, ref = world4["cases"][name], references[name]
    assert set(got["params"]) == set(ref["params"])
    diff = max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    print(f"{name}: max |param diff| {diff:.2e}, max |loss diff| {loss:.2e} after {ew.STEPS} steps")
    assert diff <= TOL and loss <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_clip_norm_counts_dense_and_expert_params_once(world4, references, name):
    """The global norm each step clipped by is torch's over the unsplit model's grads."""
    got, ref = world4["cases"][name]["norms"], references[name]["norms"]
    assert max(ref) > ew.train_config(ew.CASES[name]).clip, "the case must clip to check the norm"
    rel = max(abs(a - b) / b for a, b in zip(got, ref, strict=True))
    print(f"{name}: grad norms {[round(n, 4) for n in got[:3]]}..., max relative diff {rel:.1e}")
    assert rel <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_all_to_all_bytes_are_the_routing_counts(world4, name):
    """Per step, the ledger's ep all-to-alls carry exactly what the recorded routing says: counts,
    then rows there and back, forward and backward; and tokens really cross ranks."""
    case = world4["cases"][name]
    print(f"{name}: ledger {case['ledger_a2a_bytes'][:3]}..., from the counts {case['routed_a2a_bytes'][:3]}...")
    assert case["ledger_a2a_bytes"] == case["routed_a2a_bytes"]
    assert all(b > 0 for b in case["ledger_a2a_bytes"]) and case["received_from_others"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_experts_live_on_the_expert_mesh_and_hold_their_block(world4, references, name):
    """Expert params are flat groups on the case's expert mesh; a rank gathers only its ep block of a
    layer's experts (1/ep of what ZeRO-3 without ep gathers)."""
    spec, case = ew.CASES[name], world4["cases"][name]
    mesh = world4["meshes"][spec.mesh]
    assert case["expert_group_meshes"] == [f"{spec.mesh}.experts"]
    ep, tp = mesh["experts"]["ep_size"], ew.tp_of(spec)
    assert (ep, mesh["experts"]["edp_size"], mesh["dense"]["tp_size"]) == (ew.ep_of(spec), 4 // ep, tp)
    assert mesh["dense"]["shard_size"] == 4 // tp  # dense params stay sharded over every data-parallel rank
    ref = references[name]["params"]
    layer0 = {"gpt": "blocks.0.mlp.experts.", "mixtral": "model.layers.0.mlp.experts.",
              "qwen2moe": "model.layers.0.mlp.experts."}[spec.model]
    all_experts = sum(v.numel() * 4 for k, v in ref.items() if k.startswith(layer0))
    print(f"{name}: one layer's experts held in full during its forward: {case['expert_full_bytes_per_layer']} B "
          f"of {all_experts} B (ep {ep})")
    assert case["expert_full_bytes_per_layer"] * ep == all_experts


@pytest.mark.parametrize("name", [n for n, c in ew.CASES.items() if ew.tp_of(c) > 1])
def test_under_tp_each_token_reaches_its_experts_once_and_every_tp_rank_gets_the_output(world4, name):
    """ep with tp: the tp ranks of a group dispatch disjoint runs of its replicated tokens, whose
    rows add up to tokens x top_k, and the tp all-gathers in the ledger (outputs forward; input and
    routing-weight grads backward, unit the layer) are exactly what the recorded runs say."""
    case = world4["cases"][name]
    print(f"{name}: rows dispatched by the tp group per layer {case['dispatched_rows_over_tp']} = tokens x top_k "
          f"{case['tokens_times_top_k']}; tp all-gather bytes per step {case['tp_ledger_bytes'][:3]}..., from the "
          f"runs {case['tp_expected_bytes'][:3]}...")
    assert case["tp_split_params"] > 0  # the attention really is tensor parallel
    assert case["dispatched_rows_over_tp"] == case["tokens_times_top_k"]
    assert case["tp_ledger_bytes"] == case["tp_expected_bytes"] and all(b > 0 for b in case["tp_ledger_bytes"])


def test_the_load_balancing_loss_is_the_global_batchs(world4, references):
    """tiny-moe's aux loss uses routing shares summed over every rank and, with accumulation, over
    each global micro-batch. The ep run's losses match a reference that has it, and that reference's
    losses sit about coef x aux (0.02) above the same model's without it, so the parity checks see it."""
    name = "gpt-ep2-stage3"
    without = ew.reference(ew.CASES[name], balance=False, steps=2)["losses"]
    ref, got = references[name]["losses"][:2], world4["cases"][name]["losses"][:2]
    gaps = [a - b for a, b in zip(ref, without, strict=True)]
    print(f"{name}: the aux loss adds {gaps[0]:.4f}, {gaps[1]:.4f} to the first two losses; the ep run is "
          f"{max(abs(a - b) for a, b in zip(got, ref)):.1e} from the reference with it")
    assert min(gaps) > 1000 * TOL
    assert max(abs(a - b) for a, b in zip(got, ref)) <= TOL


@pytest.mark.parametrize("name", ["mixtral-ep2-stage3-router-aux", "qwen2moe-ep2-stage3-router-aux"])
def test_an_hf_config_with_router_logits_trains_with_transformers_aux_loss_of_the_global_batch(world4, references,
                                                                                                  name):
    """Mixtral and Qwen2-MoE with output_router_logits and router_aux_loss_coef: the (shard 2 x ep 2)
    run's losses and params match one process whose loss is transformers' own (labels= loss with
    aux_loss), one forward per global micro-batch; that loss sits coef x aux above the same model's
    without it. Each forward's counts are one all-reduce of E + 2 float64 over the dense mesh's
    data-parallel ranks, in the ledger with their dim; a config without router logits sends none."""
    spec, case = ew.CASES[name], world4["cases"][name]
    without = ew.reference(spec, balance=False, steps=2)["losses"]
    ref = references[name]["losses"]
    gaps = [a - b for a, b in zip(ref[:2], without, strict=True)]
    print(f"{name}: the aux loss adds {gaps[0]:.4f}, {gaps[1]:.4f} to the first two losses (coef "
          f"{ew.ROUTER_AUX_COEF}); the ep run's losses are {max(abs(a - b) for a, b in zip(case['losses'], ref)):.1e} "
          f"from the reference with it; router_aux records of step 1: {case['router_aux_records'][0]}")
    assert min(gaps) > 1000 * TOL
    experts = 4
    one = ("all_reduce", "world", experts + 2, "float64", "forward", case["dense_ledger_name"])
    assert case["dense_ledger_name"] == spec.mesh
    assert case["router_aux_records"] == [[one] * spec.accum] * ew.STEPS
    assert all(r == [] for r in world4["cases"]["mixtral-ep2-stage3"]["router_aux_records"])


def test_frozen_experts_get_no_grads_and_no_state(world4, references):
    case = world4["cases"]["gpt-ep2-stage2-frozen"]
    assert case["frozen_trainable"] == [False] and not case["frozen_in_optimizer"] and not case["frozen_grads"]
    ref = references["gpt-ep2-stage2-frozen"]["params"]
    frozen = [k for k in ref if k.startswith(ew.FROZEN)]
    assert frozen and all((case["params"][k] == ref[k]).all() for k in frozen)  # untouched, as in the reference


def test_a_mixtral_folder_loads_straight_into_split_experts_and_trains(world4, folder):
    """A save_pretrained folder in >= 3 files (one tensor per expert) is read at (shard 2, ep 2):
    each rank its block of every stacked expert param. Right after the load the gathered tensors are
    bitwise the folder's; 3 steps then match one process."""
    import json
    from pathlib import Path

    from zeroshard.checkpoint.hf.pretrained import plain_pretrained
    from zeroshard.trainer.train import reference_train

    assert len(set(json.loads((Path(folder) / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
    got = world4["folder"]
    whole = {k: v.detach() for k, v in plain_pretrained(folder).state_dict().items()}
    assert set(got["loaded"]) == set(whole) and got["expert_groups"] > 0
    assert all(torch.equal(got["loaded"][k], whole[k]) for k in whole)
    ref = reference_train(ew.folder_config(folder))
    diff = max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    print(f"mixtral folder at (shard 2, ep 2): loaded bitwise; after {ew.FOLDER_STEPS} steps params {diff:.2e}, "
          f"losses {loss:.2e} from one process")
    assert diff <= TOL and loss <= TOL


def test_the_trained_split_model_exports_a_folder_from_pretrained_opens(world4):
    """export_pretrained of the (shard 2, ep 2) model gathers every expert block: from_pretrained
    opens the folder with no missing or unexpected keys, and its params are the trained ones."""
    import transformers

    got = world4["folder"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(got["exported"], dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    assert all(torch.equal(state[k], got["params"][k]) for k in got["params"])



@pytest.mark.parametrize("name", [n for n, c in ew.CASES.items() if c.meta])
def test_meta_init_with_ep_is_seed_exact(world4, name):
    """A model built on meta and split over ep: zs.shard replays its init at the stacked shapes,
    each rank drawing one expert at a time and keeping its own. The gathered weights are bitwise a
    plain seeded build's, and the init's peak allocation (counted by ep_workloads.AllocationCounter)
    is one expert plus the rank's block of the largest expert param, never the whole stacked one."""
    import dataclasses

    spec, got = ew.CASES[name], world4["cases"][name]
    plain = ew.build_model(dataclasses.replace(spec, meta=False)).state_dict()
    assert got["init_stats"]["path"] == "meta"
    assert set(got["initial"]) == set(plain)
    assert all(torch.equal(got["initial"][k], plain[k]) for k in plain)
    ep = world4["meshes"][spec.mesh]["experts"]["ep_size"]
    experts = {k: v for k, v in plain.items() if ".mlp.experts." in k}
    dense = max(v.numel() * v.element_size() for k, v in plain.items() if k not in experts)
    one_expert_and_block = max(v[0].numel() * v.element_size() * (v.shape[0] // ep + 1) for v in experts.values())
    whole = max(v.numel() * v.element_size() for v in experts.values())
    print(f"{name}: init bitwise a plain build; peak allocated by the init {got['init_peak_allocated']} B "
          f"(one expert + the rank's block {one_expert_and_block} B, the whole stacked param {whole} B, "
          f"largest dense param {dense} B)")
    assert dense < one_expert_and_block < whole
    assert got["init_peak_allocated"] == one_expert_and_block == got["init_stats"]["peak_expert_temp_bytes"]


@pytest.mark.parametrize("name", list(mw.FAMILIES))
def test_a_family_with_no_zeroshard_code_splits_by_its_declared_plan(world4, families, name):
    """OLMoE, DeepSeek-V3 (dense block 0, shared expert, grouped sigmoid routing) and GPT-OSS (expert
    biases, clamped gate, with its load-balancing loss), each a save_pretrained folder at (shard 2 x
    ep 2), stage 3, as `zeroshard verify --ep 2` runs it: one process's losses and params."""
    from zeroshard.trainer.train import reference_train

    got, ref = world4["families"][name], reference_train(mw.train_config(families[name]))
    assert set(got["params"]) == set(ref["params"])
    params = max((got["params"][k].float() - ref["params"][k].float()).abs().max().item() for k in ref["params"])
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    print(f"{name}: {len(got['layers'])} MoE layers, rows sent {got['sent']}, |param diff| {params:.1e}, "
          f"|loss diff| {loss:.1e}")
    assert params <= TOL and loss <= 1e-6
    assert got["received"] > 0 and got["sent"] > 0
    first_moe = 1 if name == "deepseek_v3" else 0  # first_k_dense_replace=1: block 0 has no experts
    assert got["layers"] == [f"model.layers.{i}.mlp.experts" for i in range(first_moe, 4)]
