"""Build the embedding example's model on this machine: a small BERT encoder (4 layers x 256, random weights,
safetensors) and a WordPiece tokenizer trained on generated text, saved where AutoModel / AutoTokenizer
.from_pretrained read them. Nothing is downloaded.

    .venv/bin/pip install -r examples/requirements-embed.txt
    .venv/bin/python examples/make_embed_model.py embed-model            # the folder examples/embed_model.py reads
    .venv/bin/python examples/make_embed_model.py embed-model --texts 10000 texts.parquet   # and items to embed
"""
import argparse
import os

import numpy as np

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def words(count=6000, seed=0):
    """A vocabulary of made-up words of 1-4 syllables (an English-like spread of lengths)."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]
    return sorted({"".join(rng.choice(syllables, rng.integers(1, 5))) for _ in range(count)})


def texts(n, seed=1, low=5, high=120):
    """n texts of low-high words, drawn Zipf-like from words() (a few words common, most rare)."""
    vocab = np.array(words())
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high + 1, n)
    ranks = np.minimum(rng.zipf(1.2, int(lengths.sum())), len(vocab)) - 1
    drawn, ends = vocab[ranks], np.cumsum(lengths)
    return [" ".join(drawn[end - length:end]) for end, length in zip(ends, lengths)]


def build(folder, vocab_size=8000, seed=0):
    """Train the tokenizer on generated text, then save it and a randomly initialised BertModel into `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(texts(4000, seed=seed + 100), trainers.WordPieceTrainer(   # rare words: pieces
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    BertTokenizerFast(tokenizer_object=tokenizer, model_max_length=512).save_pretrained(folder)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=256, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=1024, max_position_embeddings=512)
    BertModel(config).eval().save_pretrained(folder, safe_serialization=True)


def write_texts(path, n):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": np.arange(n), "text": texts(n)}), path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where to save the model and tokenizer")
    parser.add_argument("--texts", nargs=2, metavar=("N", "PATH"), help="also write N texts to a Parquet file")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.folder, "model.safetensors")):
        build(args.folder)
    print(f"model and tokenizer in {args.folder}")
    if args.texts:
        write_texts(args.texts[1], int(args.texts[0]))
        print(f"{args.texts[0]} texts in {args.texts[1]}")
