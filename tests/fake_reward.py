"""A reward with spread on an untrained model (the parity of the completion's length), so that loop
tests train. `python tests/fake_reward.py --key=value ...` runs train.py with it (used under
torchrun by the tests)."""
import os
import sys


def use_parity_reward(setattr_):
    import reward
    orig = reward.Cascade.score_batch

    def score_batch(self, problems, texts, group_size=1, **kw):
        res = orig(self, problems, texts, group_size, **kw)
        res.rewards = [float(len(t) % 2) for t in texts]
        return res

    setattr_(reward.Cascade, "score_batch", score_batch)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train
    use_parity_reward(setattr)
    sys.exit(train.cli(train.main, sys.argv[1:]))
