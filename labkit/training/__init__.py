"""Training, and the measurements that steer it: the corpus and the target's own answers (corpus.py,
distill.py), its features (features.py), Medusa's and EAGLE's heads (train_medusa.py, train_eagle.py,
eagle_loss.py), acceptance replayed on held-out text (replay.py), the data curve (data_curve.py), and
the multi-token models (mtp_data.py, mtp_loss.py, train_mtp.py). Each trainer is also
`python -m labkit train NAME`."""
