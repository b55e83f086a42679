"""Bad mixture-of-experts inputs through `jaxrl-llm train` (in a tmp cwd): a Qwen3-MoE
checkpoint holding fewer experts per layer than its config.json says, a config.json whose
top-k exceeds its expert count, a random MoE whose top-k exceeds its expert count, and an
expert count the mesh's expert axis does not divide. Each exits 2 before any training with a
message naming the file or key and both numbers, and writes no checkpoint or metrics.

The checkpoints are written here from the public format (a hand-written Qwen3-MoE config.json
and safetensors with transformers' per-expert tensor names and [out, in] shapes), not by this
project's exporter. Rows go to RELIABILITY.md (tests/reliability.py), section "bad input".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from jaxrl_llm.data.shards import write_records
from tests.bad_inputs.test_bad_models_cli import TRAIN, fails_naming, small_tokenizer, train
from tests.data.helpers import make_records
from tests.reliability import record

pytestmark = pytest.mark.reliability

V, D, F, LAYERS, HEADS, KV, HEAD_DIM, EXPERTS = 256, 32, 16, 2, 4, 2, 8, 4


def qwen3_moe_config(**changes) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": V, "hidden_size": D, "intermediate_size": 64,
            "moe_intermediate_size": F, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM,
            "num_experts": EXPERTS, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": "float32", **changes}


def qwen3_moe_tensors(experts: int) -> dict[str, np.ndarray]:
    """transformers' Qwen3-MoE names and shapes, `experts` experts per layer."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D),
              "model.norm.weight": (D,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
                   p + "self_attn.k_proj.weight": (KV * HEAD_DIM, D),
                   p + "self_attn.v_proj.weight": (KV * HEAD_DIM, D),
                   p + "self_attn.o_proj.weight": (D, HEADS * HEAD_DIM),
                   p + "self_attn.q_norm.weight": (HEAD_DIM,),
                   p + "self_attn.k_norm.weight": (HEAD_DIM,),
                   p + "mlp.gate.weight": (experts, D)}
        for e in range(experts):
            shapes |= {p + f"mlp.experts.{e}.gate_proj.weight": (F, D),
                       p + f"mlp.experts.{e}.up_proj.weight": (F, D),
                       p + f"mlp.experts.{e}.down_proj.weight": (D, F)}
    return {name: (0.05 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def write_moe(directory: str, *, experts: int = EXPERTS, **config) -> None:
    Path(directory).mkdir()
    Path(directory, "config.json").write_text(json.dumps(qwen3_moe_config(**config)))
    safetensors.numpy.save_file(qwen3_moe_tensors(experts), f"{directory}/model.safetensors",
                                metadata={"format": "pt"})
    small_tokenizer().save_pretrained(directory)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_moe")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(root)
        write_moe("good_moe")
        write_moe("three_experts", experts=3)
        write_moe("top5_of_4", num_experts_per_tok=5)
        write_records("recs", make_records(16, group_size=4), records_per_shard=8)
    return root


@pytest.fixture
def cwd(inputs, tmp_path, monkeypatch) -> Path:
    for entry in inputs.iterdir():
        (tmp_path / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    Path(tmp_path, "c.yaml").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_good_moe_checkpoint_loads(cwd):
    from jaxrl_llm.weights.hf import load_pretrained

    model = load_pretrained("good_moe")
    assert model.config.num_experts == EXPERTS and model.layers[0].mlp.gate.shape == (4, D, F)


CASES = [
    ("MoE: checkpoint with fewer experts than its config", "three_experts",
     ["three_experts", "holds 3 experts in layer 0", "num_experts=4"]),
    ("MoE: top-k larger than the expert count (config.json)", "top5_of_4",
     ["top5_of_4/config.json", "num_experts_per_tok=5 (top-k)", "num_experts=4"]),
]


@pytest.mark.parametrize("what,directory,named", CASES, ids=[c[1] for c in CASES])
def test_bad_moe_checkpoint_refused_by_train(what, directory, named, cwd, capsys):
    first = fails_naming(train("model.source=hf", f"model.path={directory}"), capsys, *named)
    record("bad input", what, runs=1, failures=0,
           detail=f"train model.source=hf model.path={directory} -> {first}")


RANDOM = ("model.family=mixtral", "model.vocab_size=256", "model.hidden_size=32",
          "model.intermediate_size=16", "model.num_heads=4", "model.num_kv_heads=2")


def test_random_moe_with_top_k_above_its_experts_is_refused(cwd, capsys):
    first = fails_naming(train(*RANDOM, "model.num_experts=4", "model.num_experts_per_tok=6"),
                         capsys, "model.num_experts_per_tok=6 (top-k)", "model.num_experts=4")
    record("bad input", "MoE: top-k larger than the expert count (model: keys)", runs=1,
           failures=0, detail=f"train model.family=mixtral model.num_experts=4 "
                              f"model.num_experts_per_tok=6 -> {first}")


@pytest.mark.parametrize("source", ["random", "hf"])
def test_expert_axis_that_does_not_divide_the_experts_is_refused(source, cwd, capsys):
    """mesh.expert=8 over 8 (fake CPU) devices: 6 random experts, 4 in the checkpoint."""
    model = (RANDOM + ("model.num_experts=6", "model.num_experts_per_tok=2")
             if source == "random" else ("model.source=hf", "model.path=good_moe"))
    experts = 6 if source == "random" else 4
    first = fails_naming(train(*model, "mesh.data=1", "mesh.expert=8"), capsys,
                         "mesh.expert=8 does not divide the experts",
                         f"num_experts={experts}")
    record("bad input", f"MoE: expert axis that does not divide the experts ({source})",
           runs=1, failures=0, detail=f"train {' '.join(model)} mesh.expert=8 -> {first}")
