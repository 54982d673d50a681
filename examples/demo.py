"""`make demo`: plait's main job on the embedded SmolLM2-135M-Instruct, end to end.

Loads the default model offline, then runs a chat answer (streamed), a batch of prompts in one
call, and a scoring call with prompt logprobs.
"""

from __future__ import annotations

import sys
import time

from plait import Engine


def main() -> int:
    start = time.perf_counter()
    engine = Engine()
    print(f"loaded {engine.model_path} in {time.perf_counter() - start:.1f}s\n")
    try:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Give me one tip for writing clear code."}]
        )
        print("chat (streamed):")
        shown = 0
        for chunk in engine.generate(prompt, {"max_new_tokens": 64, "temperature": 0}, stream=True):
            sys.stdout.write(chunk["text"][shown:])
            sys.stdout.flush()
            shown = len(chunk["text"])
        print("\n")

        questions = ["The capital of Japan is", "Water boils at", "The largest planet is"]
        outs = engine.generate(
            questions, {"max_new_tokens": 12, "temperature": 0, "stop": ["\n", "."]}
        )
        print("batch of three, one call:")
        for q, out in zip(questions, outs):
            print(f"  {q}{out['text']}")

        scored = engine.generate(
            "The sky is blue.",
            {"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=0,
            return_text_in_logprobs=True,
        )
        print("\nprompt logprobs:")
        for logprob, _, text in scored["meta_info"]["input_token_logprobs"]:
            print(f"  {text!r:>10} {'-' if logprob is None else f'{logprob:.2f}'}")
        print(f"\nstats: {engine.stats()}")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
