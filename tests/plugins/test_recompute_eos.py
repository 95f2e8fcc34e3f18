"""The dummy plugin engine (`infer_engine=recompute`) ends a response where the hf engine (and vLLM) end it: on the
tokenizer's EOS as well as generation_config.json's, which a fine-tuned checkpoint may have set apart. It stopped
on the generation config's only, so the same greedy prompt gave a longer response, finish "length" instead of
"stop", than the engines it stands in for."""

from __future__ import annotations

from pathlib import Path

from roll_core.interfaces import SamplingParams


def test_recompute_stops_on_the_tokenizers_eos_as_the_hf_engine_does(tmp_path: Path) -> None:
    import os

    from roll_dummy_engine.engine import RecomputeInferEngine
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_engines.infer.hf import HFInferEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    tiny = resolve_model_path("builtin:tiny")
    model, tok = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    prompt = list(tok("What is 1+2?")["input_ids"])
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    free = HFInferEngine(tiny)
    try:
        ref = free.generate([prompt], greedy.replace(ignore_eos=True)).responses[0].tolist()
    finally:
        free.shutdown()
    end = ref[3]  # the tokenizer's EOS becomes the greedy response's 4th token; the generation config's stays 2
    assert end != model.generation_config.eos_token_id
    tok.eos_token = tok.convert_ids_to_tokens(end)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    want = ref[: ref.index(end) + 1]
    hf, rc = HFInferEngine(str(folder)), RecomputeInferEngine(str(folder))
    try:
        for engine in (hf, rc):
            out = engine.generate([prompt], greedy)
            got = out.responses[0][out.response_mask[0].bool()].tolist()
            assert (got, out.finish_reasons) == (want, ["stop"]), engine.name
    finally:
        hf.shutdown()
