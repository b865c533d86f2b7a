"""The BERT-style masked language model of Tally's "bert" presets (nn/models/bert.h) as plain
PyTorch on nn.TransformerEncoder, with Tally's parameter names: embeddings.{word_embeddings,
position_embeddings, token_type_embeddings, LayerNorm}, encoder.layers.N.* (PyTorch's own),
mlm_head.{dense, layer_norm, decoder} with the decoder's weight tied to the word embedding.
The loss is cross-entropy over the masked positions (target -100 elsewhere)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

# preset: (vocab_size, hidden, layers, heads, intermediate, max_positions)
PRESETS = {
    "tiny": (256, 64, 2, 2, 128, 32),
    "bert-base": (30522, 768, 12, 12, 3072, 512),
    "bert-large": (30522, 1024, 24, 16, 4096, 512),
}
TYPE_VOCAB, EPS, DROPOUT = 2, 1e-12, 0.0


class BertEmbeddings(nn.Module):
    def __init__(self, vocab, hidden, max_pos):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.token_type_embeddings = nn.Embedding(TYPE_VOCAB, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=EPS)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, ids):
        pos = torch.arange(ids.size(1), device=ids.device)
        types = torch.zeros_like(ids)
        x = self.word_embeddings(ids) + self.token_type_embeddings(types)
        x = x + self.position_embeddings(pos)
        return self.dropout(self.LayerNorm(x))


class BertMLMHead(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.layer_norm = nn.LayerNorm(hidden, eps=EPS)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.decoder(self.layer_norm(F.gelu(self.dense(x))))


class Bert(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, intermediate, max_pos):
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, hidden, max_pos)
        layer = nn.TransformerEncoderLayer(hidden, heads, intermediate, DROPOUT, activation="gelu",
                                           layer_norm_eps=EPS, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.mlm_head = BertMLMHead(vocab, hidden)
        self.mlm_head.decoder.weight = self.embeddings.word_embeddings.weight  # tied

    def forward(self, ids):
        return self.mlm_head(self.encoder(self.embeddings(ids)))


def build(preset):
    return Bert(*PRESETS[preset])


def loss(model, input, target):
    logits = model(input)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
