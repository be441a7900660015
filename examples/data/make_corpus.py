"""Generate examples/data/corpus.txt: original, deterministic prose (public domain, CC0)."""
import random
r = random.Random(1234)
subjects = ["the old lighthouse keeper", "a young cartographer", "the river", "the night train", "my grandmother",
            "the village baker", "a tired fox", "the ship's cook", "the north wind", "a quiet student",
            "the clockmaker", "the harbour", "a stray dog", "the schoolteacher", "the mountain road"]
verbs = ["watched", "carried", "remembered", "followed", "painted", "mended", "counted", "crossed", "sang about",
         "waited for", "measured", "described", "forgot", "discovered", "guarded"]
objects = ["the grey morning", "a basket of apples", "the last lantern", "every star above the bay",
           "the broken fence", "a letter from the city", "the long winter", "the smell of bread",
           "a map of the coast", "the silver bridge", "the quiet fields", "an unfinished song",
           "the tide tables", "the market square", "a small wooden boat"]
tails = ["before the rain came", "while the bells were ringing", "as the fog lifted", "without a word",
         "for many years", "until the lamps were lit", "in the early spring", "under a pale moon",
         "after the harvest", "because nobody else would", "with great care", "at the edge of town"]
joins = ["and then", "but later", "so that", "while", "because", "although"]
def sentence():
    s = f"{r.choice(subjects)} {r.choice(verbs)} {r.choice(objects)}"
    if r.random() < 0.5:
        s += f" {r.choice(tails)}"
    if r.random() < 0.35:
        s += f", {r.choice(joins)} {r.choice(subjects)} {r.choice(verbs)} {r.choice(objects)}"
    return s[0].upper() + s[1:] + r.choice([".", ".", ".", "!", "?"])
paras = []
size = 0
while size < 120_000:
    p = " ".join(sentence() for _ in range(r.randint(3, 8)))
    paras.append(p)
    size += len(p) + 2
with open("examples/data/corpus.txt", "w") as f:
    f.write("\n\n".join(paras) + "\n")
