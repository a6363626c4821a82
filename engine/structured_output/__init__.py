"""Guided decoding: grammars compiled with xgrammar mask the logits of guided requests, step by step."""
