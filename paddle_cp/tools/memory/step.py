"""One measured training step, shared by pcp-memory's ranks (breakdown.py) and its planned layouts (layouts.py):
the model they train and the step's parts from Paddle's host allocator."""
from __future__ import annotations

from paddle_cp.tools.allocator import allocated, peak, reset_peak


def build_llama(args, **fields):
    """PaddleFormers' Llama of the flags' sizes, unfused RMSNorm (CPU), Paddle's SDPA unless `fields` say."""
    from paddle_cp.integrations import zoo

    pf = zoo.transformers()
    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    return pf.LlamaForCausalLM(pf.LlamaConfig(**sizes, fuse_rms_norm=False,
                                              **{"_attn_implementation": "sdpa", **fields}))


def step_parts(model, opt, inputs, start, params):
    """{part: bytes} of a training step on `inputs`, its state allocated since `start` (`params` of it by the
    model). `activations` and `logits` are None where the decoder's forward does not end inside `model(...)`'s
    forward (a pipeline runs forward and backward in one call)."""
    body_end = []
    model.model.register_forward_post_hook(lambda *_: body_end.append(allocated()))

    def step():
        loss = model(**inputs)[0]
        held = allocated()
        loss.backward()
        del loss
        opt.step()
        opt.clear_grad(set_to_zero=False)  # free the gradients: `optimizer` then counts AdamW's state alone
        return held

    loss = model(**inputs)[0]  # makes what the batch keeps (its attention plans and their device indices)
    loss.backward()
    del loss
    opt.clear_grad(set_to_zero=False)
    before = allocated()
    step()  # creates AdamW's state
    optimizer = allocated() - before
    base = allocated()
    body_end.clear()
    reset_peak()
    held = step()
    pipelined = not body_end or held < body_end[-1]
    return {"params": params, "optimizer": optimizer,
            "activations": None if pipelined else body_end[-1] - base,
            "logits": None if pipelined else held - body_end[-1], "peak": peak() - start}

