"""
How far two greedy decodes of the same prompts agree, and how close to a tie the fp32 model was where they part.

Two decodes that compute the same logits with different roundings (bf16 against fp32, a compiled decode step
against the eager one) can only choose a different greedy token where the two logits were about as close as the
roundings make them. So at each row's first difference the fp32 logits of the two choices are compared: their
margin, set against a bound derived from the roundings, says whether the difference is a near-tie or a fault. A
row agrees up to its first differing token; after that the two continuations see different contexts, so later
tokens are not compared.
"""

import torch


@torch.no_grad()
def greedy_agreement(model, prompts, reference, other, ends):
    """Compare `other` with `reference`, two greedy decodes of `prompts` by `model`: per prompt, the tokens each
    generated (Completion.tokens: the terminal token excluded). `ends`: the token ids that end a row (a row that
    stopped at the first difference chose the likelier of them under fp32).

    Returns rows, rows identical end to end, reference tokens, tokens before each row's first difference (their
    ratio is the agreement), and for each differing row the fp32 logit margin at its first difference: the logit
    of the reference's choice minus that of the other's, from the model's full fp32 forward of the prompt and the
    tokens both chose before."""
    device = model.get_device()
    rows = identical = tokens = agreeing = 0
    margins = []
    for prompt, a, b in zip(prompts, reference, other, strict=True):
        prefix = 0
        while prefix < min(len(a), len(b)) and a[prefix] == b[prefix]:
            prefix += 1
        rows += 1
        identical += a == b
        tokens += len(a)
        agreeing += prefix
        if a != b:
            with torch.autocast(device.type, enabled=False):
                logits = model(torch.tensor([list(prompt) + a[:prefix]], device=device))[0, -1].float()  # (V,)
            end = max(ends, key=lambda t: logits[t].item())
            choice_a = a[prefix] if prefix < len(a) else end
            choice_b = b[prefix] if prefix < len(b) else end
            margins.append(float(logits[choice_a] - logits[choice_b]))
    return {"rows": rows, "identical_rows": identical, "tokens": tokens, "tokens_before_first_difference": agreeing,
            "agreement": agreeing / max(tokens, 1), "fp32_margins_at_differences": margins}
