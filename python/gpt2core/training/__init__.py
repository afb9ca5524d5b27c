"""The training run: the loop and its command line (train), learning-rate schedules (schedule), the run folder
(runfolder), graceful preemption (preemption), loss-spike detection (outliers), TensorBoard / W&B (trackers) and
the plots of runs (plot)."""
