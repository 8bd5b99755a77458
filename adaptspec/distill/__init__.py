"""Draft co-design: distil a draft (a feature-level head or an independent model) for a target.

`adaptspec distill` (cli.py) runs corpus.py -> data.py -> train.py; head.py holds the head
and its inference form.
"""
