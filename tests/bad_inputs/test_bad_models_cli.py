"""Bad model inputs, one at a time through the public command (`jaxrl_llm.cli.main` in a tmp
cwd, relative paths): HF directories with a missing or misshapen tensor, an unknown
architecture or an unsupported RoPE type; GGUF files with an unsupported quantisation or
architecture; a tokenizer larger than the model's vocabulary; paths that are not a model or
checkpoint. Each exits 2 before any training, generation or export, with a message naming the
file and the tensor / field / key, and writes no checkpoint, metrics, scores or export.

The inputs are written here from their public formats (safetensors + a hand-written Llama
`config.json`; `gguf.GGUFWriter`), not by this project's exporters. Rows go to RELIABILITY.md
(tests/reliability.py), section "bad input".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from jaxrl_llm.cli import main
from jaxrl_llm.data.shards import write_records
from tests.data.helpers import make_records
from tests.reliability import record

pytestmark = pytest.mark.reliability

V, D, F, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 32, 64, 2, 4, 2, 8
TRAIN = ("run_dir: run\nloss: {name: topr}\n"
         "train: {steps: 2, batch_size: 8, checkpoint_every: 1, max_seq_len: 32}\n")
EVAL = ["--task", "arithmetic", "--n", "2", "--num-questions", "2", "--out", "ev",
        "eval.max_new_tokens=4", "eval.batch_size=2"]


# -- inputs, from the public formats ----------------------------------------------------------

def llama_config() -> dict:
    """A tiny Llama `config.json` as transformers writes it (untied, no RoPE scaling)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
            "hidden_size": D, "intermediate_size": F, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": "float32"}


def llama_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """HF Llama tensor names and [out, in] shapes (transformers' modeling_llama)."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D),
              "model.norm.weight": (D,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, D),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, D),
                   p + "self_attn.o_proj.weight": (D, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                   p + "mlp.down_proj.weight": (D, F)}
    return {name: (0.05 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def write_hf(directory: str, *, config: Callable[[dict], None] | None = None,
             tensors: Callable[[dict], None] | None = None, tokenizer=None) -> str:
    """An HF directory (config.json, model.safetensors, tokenizer files), with one defect."""
    Path(directory).mkdir()
    hf, weights = llama_config(), llama_tensors()
    if config:
        config(hf)
    if tensors:
        tensors(weights)
    Path(directory, "config.json").write_text(json.dumps(hf))
    safetensors.numpy.save_file(weights, f"{directory}/model.safetensors",
                                metadata={"format": "pt"})
    (tokenizer or small_tokenizer()).save_pretrained(directory)
    return directory


def small_tokenizer(extra: int = 0):
    """The char tokenizer (~100 tokens), plus `extra` single-character tokens."""
    from jaxrl_llm.models.tokenizer import CHAR_ALPHABET, build_char_tokenizer

    return build_char_tokenizer(CHAR_ALPHABET + "".join(chr(0x400 + i) for i in range(extra)))


GGUF_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġ", "ab", "Ġab"]


def write_gguf(path: str, *, arch: str = "llama", quant: dict[str, str] | None = None,
               extra_tokens: int = 0) -> str:
    """A tiny llama.cpp GGUF written with gguf-py's `GGUFWriter` (F32; `quant` names tensors
    stored instead as raw blocks of another ggml type, zero bytes of the right size)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(V)
    tokens = GGUF_TOKENS + [f"t{i}" for i in range(extra_tokens)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    hf = llama_tensors()
    names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "output_norm.weight": "model.norm.weight"}
    block = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(LAYERS):
        names |= {f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in block.items()}
    for name, hf_name in names.items():
        w = hf[hf_name]
        kind = (quant or {}).get(name)
        if kind is None:
            writer.add_tensor(name, w)
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((w.shape[0], w.shape[1] // block_size * type_size), np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)  # shape in bytes per row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- the bad inputs, built once ---------------------------------------------------------------

def _drop(name: str) -> Callable[[dict], None]:
    return lambda t: t.pop(name)


def _misshape(t: dict) -> None:
    t["model.layers.1.mlp.gate_proj.weight"] = t["model.layers.1.mlp.gate_proj.weight"][:-1]


def _gpt_neox(c: dict) -> None:
    c.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])


def _dynamic(c: dict) -> None:  # a transformers 4.x config.json: rope_scaling with "type"
    c["rope_scaling"] = {"type": "dynamic", "factor": 4.0}


def _dynamic_over_default(c: dict) -> None:
    """Both keys, as in a hand-merged file: transformers reads the legacy rope_scaling
    (dynamic) over rope_parameters, so reading "default" from the latter would silently
    differ."""
    _dynamic(c)
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_models")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(root)
        write_hf("good")
        write_hf("missing_tensor", tensors=_drop("model.layers.1.mlp.up_proj.weight"))
        write_hf("misshapen", tensors=_misshape)
        write_hf("unknown_arch", config=_gpt_neox)
        write_hf("dynamic", config=_dynamic)
        write_hf("dynamic_over_default", config=_dynamic_over_default)
        write_hf("big_tokenizer", tokenizer=small_tokenizer(extra=200))
        small_tokenizer(extra=200).save_pretrained("big_tok")
        write_gguf("good.gguf")
        write_gguf("q8_1.gguf", quant={"blk.1.attn_v.weight": "Q8_1"})
        write_gguf("gptneox.gguf", arch="gptneox")
        write_gguf("big_vocab.gguf", extra_tokens=V)
        write_records("recs", make_records(16, group_size=4), records_per_shard=8)
        write_records("recs_v300", make_records(16, group_size=4, vocab=300), records_per_shard=8,
                      vocab_size=300)
    return root


@pytest.fixture
def cwd(inputs, tmp_path, monkeypatch) -> Path:
    """A fresh cwd with (links to) every input, so outputs of one case never meet another."""
    for entry in inputs.iterdir():
        (tmp_path / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    Path(tmp_path, "c.yaml").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    return tmp_path


OUTPUTS = ("run/metrics.jsonl", "run/tensorboard", "ev", "sc", "gen", "ex")


def fails_naming(argv: list[str], capsys, *named: str) -> str:
    """Exit 2 with every `named` text in the message; no training, scores, samples or export."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    assert "Traceback" not in err
    for text in named:
        assert text in err, (text, err)
    written = [p for p in OUTPUTS if Path(p).exists()]
    written += [p.name for p in Path("run/checkpoints").glob("*")]  # the empty dir may exist
    assert written == [], written
    last = err.splitlines()[-1].removeprefix(f"jaxrl-llm {argv[0]}: ")
    return last.replace(f"{Path.cwd()}/", "")  # the table must not depend on the tmp dir


def train(*overrides: str) -> list[str]:
    return ["train", "--config", "c.yaml", "--no-progress", "--records", "recs", *overrides]


# -- the good inputs load (so each failure below is its one defect) ---------------------------

def test_the_good_inputs_load(cwd):
    from jaxrl_llm.weights.gguf import load_gguf
    from jaxrl_llm.weights.hf import load_pretrained

    assert load_pretrained("good").config.vocab_size == V
    loaded = load_gguf("good.gguf")
    assert loaded.model.config.num_layers == LAYERS and len(loaded.tokenizer) == len(GGUF_TOKENS)


# -- HF directories ---------------------------------------------------------------------------

HF_CASES = [
    ("HF dir: missing tensor", "missing_tensor",
     ["missing_tensor", "model.layers.1.mlp.up_proj.weight", "model.safetensors"]),
    ("HF dir: misshapen tensor", "misshapen",
     ["misshapen/model.safetensors", "model.layers.1.mlp.gate_proj.weight", "[63, 32]", "[64, 32]"]),
    ("HF dir: unknown architecture", "unknown_arch",
     ["unknown_arch/config.json", "model_type='gpt_neox'"]),
    ("HF dir: unsupported rope_scaling type", "dynamic",
     ["dynamic/config.json", "rope_scaling", "'dynamic'"]),
    ("HF dir: rope_scaling dynamic beside rope_parameters default", "dynamic_over_default",
     ["dynamic_over_default/config.json", "rope_scaling", "'dynamic'"]),
]


@pytest.mark.parametrize("what,directory,named", HF_CASES, ids=[c[1] for c in HF_CASES])
def test_bad_hf_dir_refused_by_train_and_evaluate(what, directory, named, cwd, capsys):
    first = fails_naming(train("model.source=hf", f"model.path={directory}"), capsys, *named)
    second = fails_naming(["evaluate", "--model", directory, *EVAL], capsys, *named)
    assert second.endswith(first)  # evaluate names the directory by its absolute path
    record("bad input", what, runs=2, failures=0,
           detail=f"train model.source=hf model.path={directory} and evaluate --model "
                  f"{directory} -> {first}")


def test_bad_hf_dir_refused_by_score(cwd, capsys):
    first = fails_naming(["score", "--records", "recs", "--out", "sc", "model.source=hf",
                          "model.path=misshapen"], capsys,
                         "misshapen/model.safetensors", "model.layers.1.mlp.gate_proj.weight")
    record("bad input", "score with a misshapen HF tensor", runs=1, failures=0,
           detail=f"score --records recs model.path=misshapen -> {first}")


# -- GGUF files -------------------------------------------------------------------------------

GGUF_CASES = [
    ("GGUF: unsupported quantisation (Q8_1)", "q8_1.gguf",
     ["q8_1.gguf", "blk.1.attn_v.weight", "Q8_1"]),
    ("GGUF: unsupported architecture", "gptneox.gguf",
     ["gptneox.gguf", "general.architecture='gptneox'"]),
]


@pytest.mark.parametrize("what,file,named", GGUF_CASES, ids=[c[1] for c in GGUF_CASES])
def test_bad_gguf_refused_by_train_and_evaluate(what, file, named, cwd, capsys):
    source = ["model.source=gguf", f"model.path={file}"]
    first = fails_naming(train(*source), capsys, *named)
    fails_naming(["evaluate", *EVAL, *source], capsys, *named)
    record("bad input", what, runs=2, failures=0,
           detail=f"train / evaluate model.source=gguf model.path={file} -> {first}")


# -- a tokenizer that does not fit the model --------------------------------------------------

def test_tokenizer_larger_than_the_vocabulary_is_refused(cwd, capsys):
    n = len(small_tokenizer(extra=200))
    assert n > V
    sizes = [f"{n} tokens", f"vocab_size={V}"]
    first = fails_naming(["evaluate", "--model", "big_tokenizer", *EVAL], capsys,
                         "big_tokenizer/tokenizer.json", "big_tokenizer/config.json", *sizes)
    second = fails_naming(["evaluate", "--model", "good", "--tokenizer", "big_tok", *EVAL],
                          capsys, "big_tok/tokenizer.json", "good/config.json", *sizes)
    third = fails_naming(["generate", "--out", "gen", "data.task=arithmetic", "data.num_prompts=2",
                          "generate.max_new_tokens=8",  # within good's 128 positions
                          "model.source=hf", "model.path=good", "data.tokenizer=big_tok"],
                         capsys, "big_tok/tokenizer.json", "good/config.json", *sizes)
    fourth = fails_naming(train("model.source=gguf", "model.path=big_vocab.gguf"), capsys,
                          "big_vocab.gguf", "tokenizer.ggml.tokens", f"{len(GGUF_TOKENS) + V} tokens",
                          f"vocab_size is {V}")
    record("bad input", "tokenizer larger than the model's vocabulary", runs=4, failures=0,
           detail=f"evaluate --model big_tokenizer -> {first}; evaluate --tokenizer big_tok -> "
                  f"{second}; generate data.tokenizer=big_tok -> {third}; train on a GGUF whose "
                  f"token list exceeds its vocab_size -> {fourth}")


# -- paths that are not a model or a checkpoint -----------------------------------------------

def test_paths_that_are_not_a_model_or_checkpoint(cwd, capsys):
    evaluate = fails_naming(["evaluate", "--model", "nowhere", *EVAL], capsys, "nowhere",
                            "not a checkpoint")
    config_path = fails_naming(["evaluate", *EVAL, "model.source=hf", "model.path=nowhere"], capsys,
                               "nowhere", "config.json")
    # its own directory: the message lists the parent's files, which must not depend on which
    # other tests of this module wrote theirs first (RELIABILITY.md is diffed in CI)
    Path("ggufs").mkdir(exist_ok=True)
    Path("ggufs/good.gguf").write_bytes(Path("good.gguf").read_bytes())
    gguf = fails_naming(train("model.source=gguf", "model.path=ggufs/nowhere.gguf"), capsys,
                        "ggufs/nowhere.gguf", "ggufs/ holds: good.gguf")
    export = fails_naming(["export", "--checkpoint", "recs", "--out", "ex"], capsys, "recs",
                          "not a checkpoint")
    score = fails_naming(["score", "--records", "nowhere", "--out", "sc"], capsys, "nowhere",
                         "manifest.json")
    record("bad input", "evaluate --model of a missing path", runs=2, failures=0,
           detail=f"--model nowhere -> {evaluate}; model.path=nowhere -> {config_path}")
    record("bad input", "train on a missing GGUF file", runs=1, failures=0, detail=gguf)
    record("bad input", "export of a directory that is not a checkpoint", runs=1, failures=0,
           detail=f"export --checkpoint recs -> {export}")
    record("bad input", "score of a missing records directory", runs=1, failures=0,
           detail=f"score --records nowhere -> {score}")


def test_score_records_beyond_the_model_vocabulary(cwd, capsys):
    first = fails_naming(["score", "--records", "recs_v300", "--out", "sc", "model.source=hf",
                          "model.path=good"], capsys, "recs_v300", "vocab")
    record("bad input", "score records whose ids exceed the model's vocabulary", runs=1,
           failures=0, detail=f"score --records recs_v300 (vocab 300) model.path=good (256) -> {first}")
