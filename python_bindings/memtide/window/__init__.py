"""The layer window (STRONGHOLD): train a stack of blocks whose parameters do not all fit on the
device. Only a window of blocks holds its parameters in device memory; the others live in host
memory, and each block is copied in one window ahead of the computation, forward and then
backward, into one of a fixed pool of buffers used round robin (the allocator sees no churn).

    window = LayerWindow(model.blocks, size="auto")   # from memtide.window; before the first forward
    for batch in data:
        loss = model(batch).loss
        loss.backward()          # gradients of finished blocks go to host memory as backward goes on
        opt.step()               # the optimizer updates the host copies (the blocks' home)
        opt.zero_grad(set_to_none=True)

Between iterations the windowed parameters and their gradients are host tensors, so any torch
optimizer (on CPU tensors) updates them in place; the first window of the next forward is
fetched as soon as ``window.attach_optimizer(opt)``'s optimizer finishes its step. Modules outside
``blocks`` (embeddings, head) stay where they are.

Correctness does not rest on timing: a block is used only after its copy has completed, a buffer
is reused only after the block that held it is done with it (forward) or has sent its gradients
out (backward), and every tensor autograd saves that lives in a window buffer (a parameter or a
view of one) is saved as a reference that backward resolves against the block's current buffer,
fetching it again if it was evicted. Activation checkpointing works the same way.

Each block is called at most once per forward, in the stack's order; a forward may skip blocks
(a block the forwards since the last backward never ran has no backward, so its buffer is free
for the blocks below from backward's start).

Window size: ``size=int`` is used as given; ``size="auto"`` trains the first ``profile_iterations``
iterations with the largest window the memory allows while timing every block's forward,
backward and copies, then takes the knee of STRONGHOLD's model (tiering::choose_window; see
docs/layer_window.md).
"""

from .layer_window import LayerWindow

__all__ = ["LayerWindow"]
