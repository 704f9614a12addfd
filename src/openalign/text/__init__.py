"""WordPiece tokenizers: load a trained vocabulary (HF `tokenizers` JSON or BERT vocab.txt) or train one."""

from openalign.text.tokenizer import IdTokenizer, TextTokenizer, Tokenizer, load_tokenizer, train_wordpiece

__all__ = ["IdTokenizer", "TextTokenizer", "Tokenizer", "load_tokenizer", "train_wordpiece"]
