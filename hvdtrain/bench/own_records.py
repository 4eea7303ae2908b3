"""The startup section's user: TFRecord files in their own schema, read the way tf.data users write it
(list_files, interleave, map(parse)), so that hvdtrain shards them by file. `dataset` is given to
hvdtrain as `--data hvdtrain.bench.own_records:dataset`, with the files in $RECORDS."""
import os

SCHEMA = {"pixels": ([64], "float32"), "label": ([], "int64")}


def dataset():
    import tensorflow as tf

    schema = {k: tf.io.FixedLenFeature(shape, dtype) for k, (shape, dtype) in SCHEMA.items()}

    def parse(record):
        ex = tf.io.parse_single_example(record, schema)
        return tf.reshape(ex["pixels"], (8, 8, 1)), ex["label"]

    files = tf.data.Dataset.list_files(os.environ["RECORDS"], shuffle=False)
    return files.interleave(tf.data.TFRecordDataset, cycle_length=4).map(parse)


def write(folder: str, x, y, num_files: int = 8):
    """x: (n, 8, 8, 1) floats, y: n integer labels, dealt round-robin over num_files files."""
    import tensorflow as tf

    os.makedirs(folder, exist_ok=True)
    writers = [tf.io.TFRecordWriter(os.path.join(folder, f"part-{i:03d}.tfrecord")) for i in range(num_files)]
    for i, (xi, yi) in enumerate(zip(x, y)):
        writers[i % num_files].write(tf.train.Example(features=tf.train.Features(feature={
            "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=xi.reshape(-1).tolist())),
            "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(yi)])),
        })).SerializeToString())
    for w in writers:
        w.close()
