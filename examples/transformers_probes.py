"""A user training loop around a ``transformers`` GPT-2 with detached probes.

    python examples/transformers_probes.py

A tiny ``GPT2LMHeadModel`` (built from a ``GPT2Config`` in code: random
weights, nothing downloaded) returns its own LM loss; a linear probe per layer
reads that layer's hidden states detached and predicts the current token; the
probes' losses are added to the LM loss. The loop is the user's own (AdamW),
compiled with ``torch.compile(model, backend="erase")`` (the drop-in), then
the same loop with the whole step in one CUDA graph (``erase_fx.compile_step``;
without a GPU it runs as written and says so). It prints the early blocks
erase found in each graph Dynamo made, and why the rest stay in the backward.

As written, Dynamo splits the forward into four graphs at two places in
transformers (5.x) and finds one early block (the first probe);
`fewer_graph_breaks` removes both breaks: one graph, two early blocks (the
whole GPT-2 with its LM loss, and the first probe).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import erase_fx


class GPT2WithProbes(nn.Module):
    def __init__(self, layers=2, width=32, vocab=64, context=16):
        super().__init__()
        config = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers,
                            n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=vocab - 1, eos_token_id=vocab - 1)
        self.gpt = GPT2LMHeadModel(config)
        self.probes = nn.ModuleList(nn.Linear(width, vocab) for _ in range(layers))

    def forward(self, ids):
        out = self.gpt(ids, labels=ids, output_hidden_states=True)
        loss = out.loss
        for probe, hidden in zip(self.probes, out.hidden_states[1:]):
            logits = probe(hidden.detach())
            loss = loss + F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        return loss


def fewer_graph_breaks(model, ids):
    """Remove the two places where Dynamo breaks the graph in transformers' GPT-2."""
    # NB: the class name GPT2LMHeadModel maps to no loss type: every call of
    # model.loss_function logs a warning (transformers/modeling_utils.py:4824), a graph break
    model.gpt.loss_type = "ForCausalLM"
    # NB: the first call installs the hooks that collect hidden states under a threading
    # lock (transformers/utils/output_capturing.py:239), a graph break the compiled code keeps
    with torch.no_grad():
        model(ids)


def token_batches(steps, batch=2, context=16, vocab=64, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, context), generator=g).to(device)
            for _ in range(steps)]


def make_step(forward, optimizer):
    """One step of the user's loop: zero the grads, forward, backward, update."""
    def step(ids):
        optimizer.zero_grad(set_to_none=True)
        loss = forward(ids)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def train(model, batches, whole_step=False, capturable=None, **compile_kwargs):
    """Train ``model`` on ``batches`` with AdamW, compiled with ``compile_kwargs`` (none:
    eager); returns the last loss and the step (an `erase_fx.CompiledStep` if ``whole_step``)."""
    forward = torch.compile(model, **compile_kwargs) if compile_kwargs else model
    if capturable is None:
        capturable = next(model.parameters()).is_cuda
    # NB: capturable keeps AdamW's step count on the GPU, as a captured step needs
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=capturable)
    step = make_step(forward, optimizer)
    if whole_step:
        step = erase_fx.compile_step(step)
    for ids in batches:
        loss = step(ids)
    return loss, step


def print_blocks(reports):
    for report in reports:
        for block in report.blocks:
            print(f"  graph {report.graph_id}: early block {block.id}: "
                  f"{len(block.params)} parameters ({block.params[0]}, ...)")
        for rest in report.rejected:
            print(f"  graph {report.graph_id}: in the backward: {len(rest.params)} "
                  f"({rest.reason}: {rest.detail})")


def main(steps=10, options=None):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = token_batches(steps, device=device)
    for fix in (False, True):
        torch._dynamo.reset()  # NB: else the second model reuses the first one's graphs
        torch.manual_seed(0)
        model = GPT2WithProbes().to(device)
        if fix:
            fewer_graph_breaks(model, batches[0])
        with erase_fx.collect_reports() as reports:
            loss, _ = train(model, batches, backend="erase", options=options or {})
        print(f"drop-in{' with fewer_graph_breaks' if fix else ''}: final loss {loss:.4f}, "
              f"{len(reports)} graph(s)")
        print_blocks(reports)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT2WithProbes().to(device)
    fewer_graph_breaks(model, batches[0])
    loss, step = train(model, batches, whole_step=True, backend="erase", options=options or {})
    print(f"whole step: final loss {loss:.4f}; {step.captures} capture(s), {step.replays} "
          f"replays; uncaptured: {step.uncaptured_reason}")


if __name__ == "__main__":
    main()
