"""The answer a user reads first, from a diagnose result dict alone: status and reasons (decide), where β meets the
user's loss for each trainer setup (setups, exposure), the changes as the user's framework spells them (changes), and
the verdict paragraph (verdict_text, fp8_text). The terminal, the JSON, the CI gate and the article all call it;
no wording recomputes a figure, and nothing here runs a model.

May import: base, precision, maths.
"""
