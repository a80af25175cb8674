"""How the Transformer may be sharded, declared in plain words beside the model (no parallel imports).

megascale.parallel turns these words into DTensor styles; the model code itself never changes. The words:
- "vocab_embedding": embedding rows sharded over the vocabulary (or positions); its output enters the
  residual stream.
- "vocab_output": output projection sharded over the vocabulary; the loss is computed on the shards.
- "sequence": an element-wise module (norm) run on a sequence shard of the residual stream.
- "gather_sequence": a module whose input is the residual stream and which needs the whole sequence.
- "position_wise_mlp": like "gather_sequence", but each position is computed alone: `w2(activate(w1 x,
  w3 x))` (w3 absent without a gate), so the sequence may be processed in chunks.
- "projected_mixer": like "gather_sequence", for `wo(mix(wq x, wk x, wv x, ...))` (attention): only `mix`
  needs the whole sequence; the projections around it are position-wise, so they may run in chunks.
- "whole_sequence": a module whose input is the residual stream and which every rank computes whole, on
  the whole sequence, with its weights unsplit (an MoE layer: its routing statistics and capacity are per
  sequence); its output is cut back to the rank's part of the residual stream.
- "own_tokens": a module each rank computes on its own part of the sequence (an MoE layer whose experts
  are split over the ranks: it sends each token slot to its expert's rank itself); its input is the rank's
  part of the residual stream, cut from the whole one where the stream is not sharded, and so is its
  output. Its routing statistics and capacity still count whole sequences (the layer is told so).
- "replicated": a module with its own weights (no submodule's) whole on every rank, each computing its
  own tokens; their gradients are summed over the ranks.
- "colwise" / "rowwise": a linear layer split by output features / by input features (Megatron).
"""

BLOCKS = "layers"

TOP_LEVEL_PLAN = {
    "tok_embeddings": "vocab_embedding",
    "pos_embeddings": "vocab_embedding",
    "norm": "sequence",
    "output": "vocab_output",
}

BLOCK_PLAN = {
    "attention_norm": "sequence",
    "ffn_norm": "sequence",
    "attention": "projected_mixer",
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward": "position_wise_mlp",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}

# A block whose feed-forward layer is a mixture of experts (models/moe.py).
ROUTED_BLOCK_PLAN = {
    **{name: word for name, word in BLOCK_PLAN.items() if not name.startswith("feed_forward")},
    "feed_forward": "whole_sequence",
}

# The same, with the MoE layer's experts split over the tensor-parallel ranks (parallel.moe_tp = "ep").
ROUTED_OWN_TOKENS_BLOCK_PLAN = {
    **ROUTED_BLOCK_PLAN,
    "feed_forward": "own_tokens",
    "feed_forward.router.gate": "replicated",
    "feed_forward.shared.w1": "replicated",
    "feed_forward.shared.w3": "replicated",
    "feed_forward.shared.w2": "replicated",
}

# Top-level modules only the first pipeline stage holds, and those only the last one holds.
FIRST_STAGE = ("tok_embeddings", "pos_embeddings")
LAST_STAGE = ("norm", "output")
