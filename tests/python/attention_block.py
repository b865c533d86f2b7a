"""Layers shared by the pytest files' small transformers (test_ab_library.py,
test_torch_parity_cuda.py)."""


def add_attention_block_layers(module, nn, dim):
    """Gives `module`, in this order, the layers of a pre-norm self-attention block and its MLP,
    built from `nn` (tally.nn or torch.nn): ln1, qkv (dim -> 3 dim), proj, ln2, fc (dim -> 4 dim)
    and out (4 dim -> dim)."""
    module.ln1 = nn.LayerNorm(dim)
    module.qkv = nn.Linear(dim, 3 * dim)
    module.proj = nn.Linear(dim, dim)
    module.ln2 = nn.LayerNorm(dim)
    module.fc = nn.Linear(dim, 4 * dim)
    module.out = nn.Linear(4 * dim, dim)
