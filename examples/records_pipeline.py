"""A user's own TFRecord files in their own schema, read the way tf.data users write it:

    RECORDS='data/records/*.tfrecord' python -m hvdtrain --model mlp --data examples.records_pipeline:dataset

hvdtrain shards it by file (every worker reads its own files, each record once per epoch). `write`
makes such files from arrays.
"""
import os

import numpy as np
import tensorflow as tf

SCHEMA = {"pixels": tf.io.FixedLenFeature([64], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}


def parse(record):
    ex = tf.io.parse_single_example(record, SCHEMA)
    return tf.reshape(ex["pixels"], (8, 8, 1)), ex["label"]


def dataset():
    files = tf.data.Dataset.list_files(os.environ.get("RECORDS", "data/records/*.tfrecord"), shuffle=False)
    return files.interleave(tf.data.TFRecordDataset, cycle_length=4).map(parse)


def write(folder: str, x: np.ndarray, y: np.ndarray, num_files: int = 8):
    os.makedirs(folder, exist_ok=True)
    writers = [tf.io.TFRecordWriter(os.path.join(folder, f"part-{i:03d}.tfrecord")) for i in range(num_files)]
    for i, (xi, yi) in enumerate(zip(x, y)):
        writers[i % num_files].write(tf.train.Example(features=tf.train.Features(feature={
            "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=xi.reshape(-1).tolist())),
            "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(yi)])),
        })).SerializeToString())
    for w in writers:
        w.close()
