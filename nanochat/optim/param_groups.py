"""
Which of a nanochat GPT's parameters each optimizer of a recipe updates, with which lr, betas and weight decay
(nanochat/optim/optimizers.py builds the optimizers from these groups; tests/optim/test_optim.py replays nanochat's own steps).

AdamW takes lm_head, the embeddings and the scalars; Muon the block matrices (value-embedding gates included,
as in nanochat).
- "2026-01" (nanochat 7312ec9, the seed's): one AdamW betas `adam_betas`, no AdamW weight decay. Its nanochat had
  no value embeddings or smear: those get the settings of their own generation's nanochat (value embeddings at
  the embedding lr, halved with betas (0.8, 0.995) from mar9 on; smear and backout at lr 0.2).
- "2026-07" (nanochat 92d63d4): per-group betas and weight decay, Muon beta2 0.9.
A generation's missing parameters (oct2025 has no lambdas) simply have no group.
"""


def recipe_param_groups(model, recipe, unembedding_lr, embedding_lr, matrix_lr, weight_decay, adam_betas, scalar_lr):
    """The param-group specs (see optim.build_optimizers) of `recipe` over every parameter of `model`, once."""
    gen = model.generation
    late = recipe == "2026-07"
    scale = (model.config.n_embd / 768) ** -0.5  # AdamW lrs were tuned at width 768; scale like 1/sqrt(width)

    def adamw(params, lr, betas=adam_betas, wd=0.0):
        return dict(kind="adamw", params=params, lr=lr, betas=betas, eps=1e-10, weight_decay=wd if late else 0.0)

    groups = [adamw(list(model.lm_head.parameters()), unembedding_lr * scale, (0.8, 0.96) if late else adam_betas, 0.01),
              adamw(list(model.transformer.wte.parameters()), embedding_lr * scale,
                    (0.8, 0.995) if late else adam_betas, 0.001)]
    if gen.value_embeds:
        halved = late or gen.short_window_divisor > 2  # mar9 on
        groups.append(adamw(list(model.value_embeds.parameters()), embedding_lr * scale * (0.5 if halved else 1.0),
                            (0.8, 0.995) if halved else adam_betas, 0.01))
    if gen.lambdas:
        # resid_lambdas multiply the whole residual stream at every layer: far more sensitive
        groups += [adamw([model.resid_lambdas], scalar_lr * 0.01, (0.8, 0.95) if late else adam_betas, 0.05),
                   adamw([model.x0_lambdas], scalar_lr, (0.96, 0.95) if late else adam_betas)]
    if gen.smear:
        groups.append(adamw([model.smear_gate.weight, model.smear_lambda, model.backout_lambda], 0.2, (0.8, 0.95)))
    groups.append(dict(kind="muon", params=list(model.transformer.h.parameters()), lr=matrix_lr, momentum=0.95,
                       ns_steps=5, beta2=0.9 if late else 0.95, weight_decay=weight_decay))
    grouped = [id(p) for g in groups for p in g["params"]]
    if sorted(grouped) != sorted(id(p) for p in model.parameters()):
        raise RuntimeError("setup_optimizers: the optimizer groups do not cover every parameter exactly once")
    return groups
