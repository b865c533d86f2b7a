"""PyTorch's side of the "lstm" model (nn/models/lstm.h): the word_language_model example's
RNNModel with an LSTM (encoder -> drop -> rnn -> drop -> decoder), batch-first like Tally's
registry batches, with the same module and parameter names."""

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # vocab, emb, hidden, layers, seq
    "tiny": (256, 64, 64, 2, 32),
    "medium": (10000, 650, 650, 2, 35),
}


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.0):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, tokens):
        emb = self.drop(self.encoder(tokens))
        out, _ = self.rnn(emb)
        return self.decoder(self.drop(out))


def build(preset):
    vocab, emb, hid, layers, _ = PRESETS[preset]
    return RNNModel(vocab, emb, hid, layers)


def loss(model, input, target):
    logits = model(input)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
