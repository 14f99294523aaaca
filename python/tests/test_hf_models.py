"""A real client (issue 21, point 4): Hugging Face transformers' Llama and Qwen3, small models built
from configs with random weights (no download), switched to rope-jit by one import
(rope_jit.dropin.hf_models), against the same models unswitched:

  * float32: logits within 1e-4, the same 32 greedy tokens from generate() with the KV cache,
    gradients of the loss within 1e-4;
  * bfloat16: the switched model's logit and gradient error against the float32 model no
    larger than the unswitched model's (our rotation computes in fp32, theirs in bf16).

On the GPU when there is one, else on the CPU (the library's CPU reference); skipped without
torch or transformers (CI installs neither)."""

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import rope_jit.dropin.hf as hf_dropin  # noqa: E402
from rope_jit.dropin import hf_models  # noqa: E402

hf_models.unpatch()  # importing it switched the models; each test switches them itself

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODELS = ["llama", "qwen3"]
# bf16 errors are compared with 5% slack: both are dominated by the other bf16 ops (measured
# on the CPU: logits 1.001x, gradients 0.97-1.02x), so a more exact rotation can land a hair above.
BF16_SLACK = 1.05


def config(kind):
    common = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen3Config(**common)


def build(kind, dtype):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(kind))
    return model.to(DEVICE, dtype).eval()


@contextlib.contextmanager
def switched():
    """rope-jit in place of every listed model's apply_rotary_pos_emb, counting its calls."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return hf_dropin.apply_rotary_pos_emb(*args, **kwargs)

    hf_models.patch()
    modules = [__import__(name, fromlist=["_"]) for name in hf_models._originals]
    for module in modules:
        module.apply_rotary_pos_emb = counting
    try:
        yield calls
    finally:
        hf_models.unpatch()


def inputs():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 24), generator=generator).to(DEVICE)


def logits_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {
        name: p.grad.detach().float().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return out.logits.detach().float(), grads


@pytest.mark.parametrize("kind", MODELS)
def test_float32_logits_gradients_and_greedy_generation_match_the_unswitched_model(kind):
    model = build(kind, torch.float32)
    input_ids = inputs()
    logits, grads = logits_and_grads(model, input_ids)
    prompt = input_ids[:, :8]
    with torch.no_grad():
        tokens = model.generate(
            prompt,
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    with switched() as calls:
        got_logits, got_grads = logits_and_grads(model, input_ids)
        assert (
            len(calls) == model.config.num_hidden_layers
        ), "the model did not call the switched function"
        with torch.no_grad():
            got_tokens = model.generate(
                prompt,
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
    assert (got_logits - logits).abs().max().item() <= 1e-4
    for name, grad in grads.items():
        torch.testing.assert_close(
            got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )
    assert got_tokens.shape[1] == prompt.shape[1] + 32
    assert torch.equal(got_tokens, tokens)


@pytest.mark.parametrize("kind", MODELS)
def test_bfloat16_switched_error_against_float32_is_no_larger_than_unswitched(kind):
    if DEVICE == "cpu" and not torch.backends.mkldnn.is_available():
        pytest.skip("no bf16 matmul on this CPU build")
    input_ids = inputs()
    reference_logits, reference_grads = logits_and_grads(build(kind, torch.float32), input_ids)
    model = build(kind, torch.bfloat16)
    logits, grads = logits_and_grads(model, input_ids)
    with switched() as calls:
        got_logits, got_grads = logits_and_grads(model, input_ids)
        assert calls
    unswitched_error = (logits - reference_logits).abs().mean().item()
    switched_error = (got_logits - reference_logits).abs().mean().item()
    assert switched_error <= unswitched_error * BF16_SLACK, (switched_error, unswitched_error)

    def grad_error(candidate):
        return (
            sum(
                (candidate[name] - grad).norm().item() ** 2
                for name, grad in reference_grads.items()
            )
            ** 0.5
        )

    assert grad_error(got_grads) <= grad_error(grads) * BF16_SLACK, (
        grad_error(got_grads),
        grad_error(grads),
    )


def test_the_transformers_kernel_entry_matches_apply_rotary_pos_emb():
    torch.manual_seed(2)
    q = torch.randn(2, 8, 5, 32, device=DEVICE)
    k = torch.randn(2, 2, 5, 32, device=DEVICE)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config("llama")).to(
        DEVICE
    )
    cos, sin = rotary(q, torch.arange(5, device=DEVICE)[None].expand(2, -1))
    want = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = hf_dropin.apply_rotary_transformers(q, k, cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_the_one_import_patches_models_imported_later_without_importing_them_itself():
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        import rope_jit.dropin.hf_models as hf_models
        from rope_jit.dropin.hf import apply_rotary_pos_emb
        assert "transformers.models.llama.modeling_llama" not in sys.modules
        import transformers
        model = transformers.LlamaForCausalLM  # transformers' lazy import of modeling_llama
        from transformers.models.qwen3 import modeling_qwen3
        from transformers.models.llama import modeling_llama
        assert modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb
        assert modeling_qwen3.apply_rotary_pos_emb is apply_rotary_pos_emb
        hf_models.unpatch()
        assert modeling_llama.apply_rotary_pos_emb is not apply_rotary_pos_emb
        print("ok", hf_models.patched_modules())
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok []" in result.stdout, result.stdout + result.stderr


def test_a_model_whose_apply_rotary_pos_emb_is_not_the_standard_one_keeps_it_with_a_warning():
    """(Adversarial pass, session 35.) Cohere's and GLM's functions rotate interleaved pairs,
    GPT-J's takes (tensor, sin, cos): switched, they computed another rotation or raised.
    patch() tries a module's own function first and keeps it when it is not the standard
    one; a listed model is switched as before."""
    from transformers.models.cohere import modeling_cohere
    from transformers.models.gptj import modeling_gptj
    from transformers.models.llama import modeling_llama

    originals = (modeling_cohere.apply_rotary_pos_emb, modeling_gptj.apply_rotary_pos_emb)
    try:
        with pytest.warns(UserWarning, match="not transformers' standard rotation"):
            patched = hf_models.patch(["cohere", "gptj", "llama"])
        assert patched == ["transformers.models.llama.modeling_llama"]
        assert modeling_llama.apply_rotary_pos_emb is hf_dropin.apply_rotary_pos_emb
        assert (modeling_cohere.apply_rotary_pos_emb, modeling_gptj.apply_rotary_pos_emb) == (
            originals
        )
    finally:
        hf_models.unpatch()


def test_models_built_on_the_meta_device_import_and_switch():
    """The check of a module's own function runs on CPU tensors whatever the default device:
    under `with torch.device("meta")` it raised, and the model's import failed (review,
    session 35)."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    if original is hf_dropin.apply_rotary_pos_emb:
        original = hf_models._originals["transformers.models.llama.modeling_llama"]
    with torch.device("meta"):
        assert hf_models._is_standard(original)
        config = transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1,
        )
        try:
            hf_models.patch(["llama"])
            model = transformers.AutoModelForCausalLM.from_config(config)
        finally:
            hf_models.unpatch()
    assert next(model.parameters()).is_meta
