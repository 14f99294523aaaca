"""A training step and a decode run of Hugging Face Llama and Qwen3 models (random weights from a
config, no download), before and after switching their RoPE to rope-jit with one import
(rope_jit.dropin.hf_models), in one process on the same model and inputs. Writes JSON.

    python python/benchmarks/hf_models_timing.py --json hf_timing.json          # GPU: bf16
    python python/benchmarks/hf_models_timing.py --tiny                         # CPU smoke run

Defaults (GPU): Llama-3-8B-shaped layers (hidden 4096, 32/8 heads, head_dim 128, MLP 14336),
4 layers, vocabulary 32000; training step = forward + backward of the LM loss on B x S tokens;
decode = generate() of --new-tokens greedy tokens with the KV cache after a --prompt-length
prompt, batch --decode-batch. Each number is the median of --repeats runs, the two variants
interleaved (before, after, before, after...) so drift affects both alike.
"""

import argparse
import json
import statistics
import time

import torch
import transformers

from rope_jit.dropin import hf_models

hf_models.unpatch()  # importing it switched the models; this script switches per measurement


def model_config(kind, tiny):
    if tiny:
        common = dict(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
        )
    else:
        common = dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        )
    common.update(
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return (transformers.LlamaConfig if kind == "llama" else transformers.Qwen3Config)(**common)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(function, device):
    synchronize(device)
    start = time.perf_counter()
    function()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def measure(kind, options, device, dtype):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config(kind, options.tiny)).to(
        device, dtype
    )
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    train_ids = torch.randint(0, vocab, (options.batch, options.seq), generator=generator).to(
        device
    )
    prompt = torch.randint(
        0, vocab, (options.decode_batch, options.prompt_length), generator=generator
    ).to(device)

    def train_step():
        model.zero_grad(set_to_none=True)
        model(input_ids=train_ids, labels=train_ids).loss.backward()

    def decode():
        with torch.no_grad():
            model.generate(
                prompt,
                max_new_tokens=options.new_tokens,
                min_new_tokens=options.new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )

    results = {}
    for name, function in (("train_step_ms", train_step), ("decode_ms", decode)):
        samples = {"before": [], "after": []}
        for variant in ("before", "after"):  # warm-up: JIT compiles, allocator, cuBLAS plans
            (hf_models.patch if variant == "after" else hf_models.unpatch)()
            for _ in range(2):
                function()
        for _ in range(options.repeats):
            for variant in ("before", "after"):
                (hf_models.patch if variant == "after" else hf_models.unpatch)()
                samples[variant].append(timed_ms(function, device))
        hf_models.unpatch()
        before, after = statistics.median(samples["before"]), statistics.median(samples["after"])
        results[name] = {"before": before, "after": after, "speedup": before / after}
        print(
            f"  {kind:<6} {name:<14} before {before:9.2f} ms   after {after:9.2f} ms   x{before / after:.3f}"
        )
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--tiny", action="store_true", help="2-layer 128-wide models (a CPU smoke run)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="training batch (default 4, tiny 2)"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help="training sequence length (default 1024, tiny 64)"
    )
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--models", default="llama,qwen3")
    options = parser.parse_args()
    options.batch = options.batch or (2 if options.tiny else 4)
    options.seq = options.seq or (64 if options.tiny else 1024)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {dtype}"
    )
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "options": vars(options),
        "models": {},
    }
    for kind in options.models.split(","):
        result["models"][kind] = measure(kind, options, device, dtype)
    if options.json:
        with open(options.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
