"""MTP drafts for a tiny DeepSeek-V3 target (:mod:`xllm_vmm.bench.tiny_checkpoint`): one that
proposes well, distilled on CPU (``bench spec``'s draft), and an untrained one (the tests').

:func:`export_mtp` writes a draft directory in the format xllm's ``tools/export_mtp.py``
produces (``DeepseekMTPForCausalLM``, ``model.enorm/hnorm/eh_proj/shared_head.*`` and the
decoder layer as ``model.layers.0.*`` in ``mtp_layer_parameters.safetensors`` with a
``model.safetensors.index.json``; tokenizer files copied). :func:`distill_mtp` trains the MTP
layer for ``steps`` Adam steps to predict the target's next-next-token distribution from
(the next token, the target's final hidden state) on the target's own greedy continuations,
starting from a copy of the target's last decoder layer; the embedding and the head are the
target's (frozen), as DeepSeek's MTP shares them.

The training forward uses transformers' own ``DeepseekV3DecoderLayer`` (dense, with autograd),
the engine runs the exported tensors through its paged MLA path — so a draft that proposes
well also checks that the two agree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MTP_FILE = "mtp_layer_parameters.safetensors"


def export_mtp(target_dir: str | Path, out_dir: str | Path, tensors: dict) -> Path:
    """Write the draft directory for ``tensors`` (exported names) next to the target's
    config (updated as export_mtp.py updates it) and tokenizer files."""
    from safetensors.torch import save_file

    target, out = Path(target_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json" \
                and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    cfg = json.loads((target / "config.json").read_text())
    n = int(cfg.get("num_nextn_predict_layers") or 1)
    cfg.update(num_hidden_layers=n, num_nextn_predict_layers=n,
               architectures=["DeepseekMTPForCausalLM"], model_type="deepseek_v3_mtp",
               quantization_config="", first_k_dense_replace=0)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / MTP_FILE))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: MTP_FILE for k in tensors}}, indent=2))
    return out


def _layer_tensors(layer, prefix: str) -> dict:
    """A transformers DeepseekV3DecoderLayer's parameters under checkpoint names (experts
    split from the fused 3D tensors into per-expert gate/up/down)."""
    out = {}
    for name, t in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[f"{prefix}.{name}"] = t
    return out


def untrained_mtp(target_dir: str | Path, out_dir: str | Path, *, seed: int = 0) -> Path:
    """An MTP draft without training (the target's last layer, unit norms, a random
    ``eh_proj``): it proposes badly, which verification must not let show in the output."""
    import torch

    from xllm_vmm.bench import tiny_checkpoint as C

    hf = C.load_hf_model(target_dir)
    hid = hf.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": hf.model.embed_tokens.weight,
        "model.shared_head.head.weight": hf.lm_head.weight,
        "model.shared_head.norm.weight": hf.model.norm.weight,
        "model.enorm.weight": torch.ones(hid), "model.hnorm.weight": torch.ones(hid),
        "model.eh_proj.weight": torch.randn(hid, 2 * hid, generator=g) * (2 * hid) ** -0.5,
        **_layer_tensors(hf.model.layers[-1], "model.layers.0"),
    }
    return export_mtp(target_dir, out_dir, tensors)


def distill_mtp(target_dir: str | Path, out_dir: str | Path, *, steps: int = 300,
                sequences: int = 24, prompt_len: int = 6, gen_len: int = 42, batch: int = 8,
                lr: float = 3e-3, seed: int = 0) -> tuple[Path, list[float]]:
    """Train and export an MTP draft for ``target_dir``; returns ``(draft dir, losses)``."""
    import copy

    import torch
    from torch import nn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    from xllm_vmm.bench import tiny_checkpoint as C

    hf = C.load_hf_model(target_dir)
    for p in hf.parameters():
        p.requires_grad_(False)
    cfg = hf.config
    hid = cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, cfg.vocab_size, (sequences, prompt_len), generator=g)
    with torch.no_grad():
        data = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                           max_new_tokens=gen_len, min_new_tokens=gen_len, eos_token_id=None,
                           pad_token_id=C.token_id(C.EOS))
        tout = hf(data, output_hidden_states=True)
        # the engine hands the draft the target's *final-normed* hidden state (StepOutput)
        hidden, tlogits = hf.model.norm(tout.hidden_states[-1]), tout.logits

    layer = copy.deepcopy(hf.model.layers[-1])
    for p in layer.parameters():
        p.requires_grad_(True)
    enorm, hnorm = DeepseekV3RMSNorm(hid, cfg.rms_norm_eps), DeepseekV3RMSNorm(hid, cfg.rms_norm_eps)
    final = copy.deepcopy(hf.model.norm)
    for p in final.parameters():
        p.requires_grad_(True)
    eh = nn.Linear(2 * hid, hid, bias=False)
    with torch.no_grad():  # start by passing the next token's embedding through
        eh.weight.copy_(torch.randn(eh.weight.shape, generator=g) * 0.02)
        eh.weight[:, :hid] += torch.eye(hid)
    params = [*layer.parameters(), *enorm.parameters(), *hnorm.parameters(),
              *final.parameters(), *eh.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    embed, head = hf.model.embed_tokens, hf.lm_head
    n = data.shape[1] - 1
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    losses = []
    for step in range(steps):
        idx = torch.randint(0, sequences, (batch,), generator=g)
        x, h, t = data[idx], hidden[idx], tlogits[idx]
        z = eh(torch.cat((enorm(embed(x[:, 1:])), hnorm(h[:, :-1])), dim=-1))
        y = layer(z, attention_mask=mask, position_ids=pos,
                  position_embeddings=hf.model.rotary_emb(z, pos))
        logits = head(final(y))  # position i predicts x_{i+2}: the target's logits at i + 1
        target = torch.softmax(t[:, 1:], dim=-1)
        loss = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    tensors = {
        "model.embed_tokens.weight": embed.weight, "model.shared_head.head.weight": head.weight,
        "model.shared_head.norm.weight": final.weight, "model.enorm.weight": enorm.weight,
        "model.hnorm.weight": hnorm.weight, "model.eh_proj.weight": eh.weight,
        **_layer_tensors(layer, "model.layers.0"),
    }
    return export_mtp(target_dir, out_dir, tensors), losses


__all__ = ["MTP_FILE", "distill_mtp", "export_mtp", "untrained_mtp"]
