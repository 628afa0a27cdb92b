"""Example banks and what is built on them: solved examples, shortlists, votes and bank classifiers.

``bank`` holds one schema's labelled states, searched by ``bm25``; ``shortlist`` gives a question its
solved examples (``x_examples``) and shortlisted options (``x_shortlist``), from a bank or, with no
labels, from a sentence encoder's meaning (``meaning``). ``lexical`` (TF-IDF) and ``dense`` (sentence
embeddings) are the classifiers a bank trains: a learned readout's partners, and the tfidf baseline.
"""
