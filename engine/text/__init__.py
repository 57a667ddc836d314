"""Text in and out: tokenizer, detokenizer, chat template, stop strings, reasoning, tools."""
