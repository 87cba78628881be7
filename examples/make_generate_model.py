"""Build the generation example's model on this machine: a small GPT-2 (4 layers x 128, random weights,
safetensors) and a byte-level BPE tokenizer trained on generated text, saved where AutoModelForCausalLM /
AutoTokenizer .from_pretrained read them. Nothing is downloaded.

    .venv/bin/pip install -r examples/requirements-embed.txt
    .venv/bin/python examples/make_generate_model.py generate-model      # the folder examples/generate_model.py reads
    .venv/bin/python examples/make_generate_model.py generate-model --prompts 300 prompts.jsonl   # and prompts
"""
import argparse
import json
import os

from make_embed_model import texts   # made-up words, Zipf-like: the same generated text as the embedding example

SPECIAL = ["<|endoftext|>", "<|pad|>"]


def prompts(n, seed=2):
    """n prompts of 5-40 words."""
    return texts(n, seed=seed, low=5, high=40)


def build(folder, vocab_size=4000, seed=0):
    """Train the tokenizer on generated text, then save it and a randomly initialised GPT2LMHeadModel into `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts(4000, seed=seed + 100), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL[0], bos_token=SPECIAL[0],
                            pad_token=SPECIAL[1], padding_side="left", model_max_length=256).save_pretrained(folder)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=256, n_embd=128, n_layer=4, n_head=4,
                        bos_token_id=tokenizer.token_to_id(SPECIAL[0]), eos_token_id=tokenizer.token_to_id(SPECIAL[0]),
                        pad_token_id=tokenizer.token_to_id(SPECIAL[1]))
    GPT2LMHeadModel(config).eval().save_pretrained(folder, safe_serialization=True)


def write_prompts(path, n):
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts(n))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where to save the model and tokenizer")
    parser.add_argument("--prompts", nargs=2, metavar=("N", "PATH"), help="also write N prompts to a JSONL file")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.folder, "model.safetensors")):
        build(args.folder)
    print(f"model and tokenizer in {args.folder}")
    if args.prompts:
        write_prompts(args.prompts[1], int(args.prompts[0]))
        print(f"{args.prompts[0]} prompts in {args.prompts[1]}")
