"""`hvdtrain bench` (hvdtrain.bench): how fast, how well it scales, and against what, measured in one run.

  scaling     the same model at 1..N workers: samples/s per worker and in total, and the scaling
              efficiency total(N) / (N x one worker), every worker at the same thread budget; beside
              it the limit with no overlap: compute / (compute + gradient bytes / allreduce bandwidth)
  levers      Horovod's and Keras' levers one at a time against hvdtrain's defaults (fp16 compression,
              fusion buffer, cycle time, grouped allreduce, MPI binding; one step per call), with one
              worker in every round: efficiency and the ratio to the defaults
  allreduce   hvd.allreduce bus bandwidth over sizes, beside mpi4py's Allreduce and a memcpy (the
              ceiling), busbw = algbw x 2(n-1)/n as nccl-tests define it
  baseline    hvdtrain at 1 worker against a plain Keras model.fit of the same model and data
  recipe      hvdtrain against Horovod's Keras recipe written by hand (bench/horovod_recipe.py)
  sync-vs-async  hvdtrain, MultiWorkerMirroredStrategy and ParameterServerStrategy (1 and 2 parameter
              servers) doing the same work: accuracy against time and samples, throughput, staleness
              (bench/sync_vs_async.py)
  startup     launch to first step on a user's own TFRecord files, against the `tfrecord:` source
  checkpoint  what --checkpoint-every-steps costs at its default N, for each built-in model
  stacks      the same hvdtrain run on this stack and on another venv's (--other-python, e.g.
              .venv-keras2/bin/python): Keras 3 against Keras 2, interleaved
  scale       2..32 ranks (--ranks, over --hosts): launch to the first step, the initial broadcast, and
              a step's allreduce (the model's gradient bytes) against the ring's bound 2(N-1)/N x
              bytes / bandwidth, the bandwidth being the 2-rank allreduce's at that size

Writes bench.json and PNG plots in --out, and prints the figures side by side.

Never imported by hvdtrain itself: it starts hvdtrain (`python -m hvdtrain ...`) and reads its summary.json,
as a user's script would. cli.py reads the flags and runs the sections (sections.py) through launch.py;
report.py prints and plots; horovod_recipe.py and sync_vs_async.py are the peers hvdtrain is measured
against; own_records.py is the user pipeline of the startup section.
"""
