"""The end of a training epoch, the same steps on every rank in the same order: BatchNorm statistics and the EMA
made rank 0's, the model and its EMA evaluated in one pass over the validation set, every rank agreeing whether
that evaluation was cut short and whether to stop, the best accuracy noted, the checkpoints saved (the epoch's
log line inside them) and the line appended to log.txt and TensorBoard. An epoch whose evaluation a stop cut
short is saved without its accuracy; the resumed run evaluates it first (EpochEnd.evaluate_resumed)."""
from dataclasses import dataclass
from typing import Any, Callable

import torch
from timm.utils import distribute_bn

import distributed
import engine
import image_folder
import train_state
from engine import EpochResult
from saver import CheckpointSaver


def accuracy_line(stats: dict, n_images: int, tag: str = '', label: str = '') -> str:
    """The accuracy line of one evaluation of the validation set of `n_images` images."""
    line = f"Accuracy of the {tag}network{label} on the {stats['n']} test images: {stats['acc1']:.2f}%"
    if stats['n'] != n_images or stats.get('seen', stats['n']) != n_images:
        line += f" (evaluated {stats['n']} of {n_images} images; undecodable ones excluded)"
    return line


@dataclass
class EpochEnd:
    """What the end of every epoch of a run works with: the validation loader and what evaluates on it (the bare
    model, or compiled, and the EMA with its compiled module or None), the saver, the training set (its
    undecodable files are counted) and TensorBoard's --log-dir with rank 0's logger (None elsewhere)."""
    loader_val: Any
    eval_model: torch.nn.Module
    model: torch.nn.Module            # the bare model: its BatchNorm statistics are made rank 0's
    model_ema: Any
    eval_ema: torch.nn.Module | None
    saver: CheckpointSaver
    dataset_train: Any
    log_dir: str
    tensorboard: Any
    device: torch.device
    amp_dtype: torch.dtype | None
    channels_last: bool
    print_freq: int
    sum_over_ranks: bool              # exact distributed evaluation (--dist-eval)
    stop_flag: Any

    def __call__(self, epoch: int, result: EpochResult) -> tuple[dict, dict | None, bool]:
        """End `epoch`, trained as `result` says: (the model's validation stats, the EMA's or None, whether
        every rank stops now)."""
        if distributed.is_dist_avail_and_initialized():
            # BatchNorm running statistics are per-rank (DDP re-broadcasts rank 0's before each forward) and
            # so are the EMA's: make every rank hold rank 0's, as in the checkpoint, before evaluating
            distribute_bn(self.model, distributed.get_world_size(), reduce=False)
            if self.model_ema is not None:  # a CPU EMA (--model-ema-force-cpu) goes through the device under NCCL
                distributed.broadcast_tensors_(list(self.model_ema.module.state_dict().values()), device=self.device)
        # distinct files: with repeated augmentation one bad file is read on up to 3 ranks
        bad = image_folder.bad_sample_count_all_ranks(self.dataset_train, self.device)
        return self.evaluate_and_save(epoch, result.stats, bad, lambda: train_state.epoch_state_entries(result.state),
                                      result.stopped)

    def evaluate_resumed(self, epoch: int, unevaluated: dict[str, Any]) -> tuple[dict, dict | None, bool]:
        """End `epoch` as an uninterrupted run would have, after a resume from its checkpoint, which a stop during
        its evaluation saved without its accuracy (`unevaluated`: its log record and where training stood, as
        resume.Resume holds them): the weights it ended with, EMA included, restored from that checkpoint, are
        evaluated, the best accuracy noted, the checkpoints saved again with it and its log.txt line completed.
        A stop that cuts this evaluation short too leaves everything as it was."""
        record = unevaluated['log']
        print(f'Epoch {epoch} was saved without its accuracy (a stop cut its evaluation short): evaluating it now, '
              f'with the weights it ended with')
        train_stats = {k[len('train_'):]: v for k, v in record.items() if k.startswith('train_')}
        entries = {k: v for k, v in unevaluated.items() if k != 'log'}
        return self.evaluate_and_save(epoch, train_stats, int(record.get('bad_train_images') or 0),
                                      lambda: entries, stopped=False, resumed=True)

    def evaluate_and_save(self, epoch: int, train_stats: dict, bad: int, entries: Callable[[], dict[str, Any]],
                          stopped: bool, resumed: bool = False) -> tuple[dict, dict | None, bool]:
        """Evaluate the weights after `epoch` (the RNG state left as it was), let every rank agree whether that was
        cut short and whether to stop, note the accuracy, save the checkpoints (`entries()`: where training
        stands, a collective) with the epoch's log record, and write that record to log.txt (`resumed`: in place
        of the line written without its accuracy) and TensorBoard. `stopped`: the epoch's training was stopped."""
        with train_state.preserved_rng():  # evaluating leaves the random stream as training left it (exact resume)
            test_stats, ema_stats = self.evaluate()
        # all ranks agree whether the evaluation was cut short and whether to stop after this epoch
        flags = [float(test_stats['aborted'] or bool(ema_stats and ema_stats['aborted'])),
                 float(self.stop_flag.requested or stopped)]
        if distributed.is_dist_avail_and_initialized():
            flags = distributed.all_reduce_max(flags, self.device)
        eval_aborted, stop_now = flags[0] > 0, flags[1] > 0
        if eval_aborted and resumed:  # its checkpoint and log line stay as they are: the next resume tries again
            print(f'Evaluation of epoch {epoch} interrupted by {self.stop_flag.name() or "a stop signal"} again: '
                  f'its checkpoint stays without its accuracy, and the same command evaluates it')
            return test_stats, ema_stats, True
        improved = self.report(epoch, test_stats, ema_stats, eval_aborted, bad)
        record = log_record(epoch, train_stats, None if eval_aborted else test_stats,
                            None if eval_aborted else ema_stats, self.saver, bad)
        # the epoch's log line travels in the checkpoint: a crash before the append loses nothing
        self.saver.save_epoch(epoch, {**entries(), 'log': record}, improved)
        if resumed:
            self.saver.replace_log(record)
        else:
            self.saver.append_log(record)
        if self.log_dir:  # every rank agrees on rank 0's write (the logger is rank 0's alone)
            distributed.on_rank0(lambda: self.tensorboard.log_epoch(record, epoch), self.device,
                                 f'--log-dir {self.log_dir}: cannot write TensorBoard events')
        return test_stats, ema_stats, stop_now

    def evaluate(self) -> tuple[dict, dict | None]:
        """The validation stats of the model and of its EMA (None without one), from one pass over the validation
        set: each batch goes through both. An EMA kept on the CPU (--model-ema-force-cpu) is evaluated on the
        device, where the data is."""
        if self.model_ema is None:
            return engine.evaluate(self.loader_val, self.eval_model, self.device, self.amp_dtype, self.channels_last,
                                   self.print_freq, sum_over_ranks=self.sum_over_ranks, stop_flag=self.stop_flag), None
        with distributed.moved_to(self.model_ema.module, self.device):
            stats = engine.evaluate_models(
                self.loader_val, {'': self.eval_model, 'EMA': self.eval_ema or self.model_ema.module}, self.device,
                self.amp_dtype, self.channels_last, self.print_freq, sum_over_ranks=self.sum_over_ranks,
                stop_flag=self.stop_flag)
        return stats[''], stats['EMA']

    def report(self, epoch: int, test_stats: dict, ema_stats: dict | None, eval_aborted: bool, bad: int) -> bool:
        """Print the epoch's accuracy lines and the best so far; whether the epoch is the best (never when its
        evaluation was cut short: it is saved without its accuracy)."""
        improved = False
        if eval_aborted:
            print(f'Evaluation of epoch {epoch} interrupted by {self.stop_flag.name() or "a stop signal"}: '
                  f'the epoch is saved without its accuracy, and the same command evaluates it first')
        else:
            n_val = len(self.loader_val.dataset)
            print(accuracy_line(test_stats, n_val))
            if ema_stats:
                print(accuracy_line(ema_stats, n_val, 'EMA '))
            improved = self.saver.record_accuracy(epoch, test_stats['acc1'], ema_stats['acc1'] if ema_stats else None)
        print(f'Max accuracy: {self.saver.max_accuracy:.2f}%'
              + (f'  (undecodable training images so far: {bad})' if bad else ''))
        return improved


def log_record(epoch: int, train_stats: dict, test_stats: dict | None, ema_stats: dict | None,
               saver: CheckpointSaver, bad: int) -> dict[str, Any]:
    """The epoch's log.txt line (test_* and test_ema_* only when its evaluation finished)."""
    return {**{f'train_{k}': v for k, v in train_stats.items()},
            **({f'test_{k}': v for k, v in test_stats.items() if k != 'aborted'} if test_stats else {}),
            **({f'test_ema_{k}': v for k, v in ema_stats.items() if k != 'aborted'} if ema_stats else {}),
            'epoch': epoch, 'n_parameters': saver.n_parameters, 'max_accuracy': saver.max_accuracy,
            'bad_train_images': bad}
