//! With `task.n` = K > 1 samples per row: per metric, the unbiased pass@k
//! over each row's samples (for 0/1 metrics) and the score of the majority
//! answer (the most frequent parsed answer among the row's usable samples;
//! ties go to the one seen first), each averaged over rows. A row's samples
//! are consecutive in the store, so rows are taken one at a time.

use std::collections::BTreeMap;

use serde::Serialize;

use super::stats;
use evalfleet_eval::metrics::Metric;

/// pass@k and majority votes of a run with several samples per row.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SamplesSummary {
    /// Samples per row.
    pub n: u32,
    pub rows: u64,
    pub metrics: Vec<MetricSamples>,
}

/// One metric's pass@k and majority vote.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct MetricSamples {
    pub metric: String,
    /// k → the mean over rows of pass@k; `None` unless every score is 0 or
    /// 1 and higher is better.
    pub pass_at: Option<BTreeMap<u64, f64>>,
    /// The mean over rows (those with a sample the metric could score) of
    /// the majority answer's score.
    pub majority: f64,
}

/// One sample of a row: each metric's value as pass@k takes it (the worst
/// for no usable answer; `None` when the metric could not score it: such a
/// sample counts in no pass@k), and the answer it votes for (none without
/// a usable answer).
struct Sample {
    judged: Vec<Option<f64>>,
    vote: Option<String>,
}

/// Rows' samples, taken as they come.
pub struct Samples {
    k: u32,
    metrics: Vec<Metric>,
    /// The k of pass@k reported: 1, 5, 10, 20, 50, 100 below K, and K.
    ks: Vec<u64>,
    row: Option<String>,
    samples: Vec<Sample>,
    rows: u64,
    /// Per metric: every value 0 or 1 so far, the sums of pass@k per k,
    /// and the sum of majority scores.
    binary: Vec<bool>,
    pass_sums: Vec<Vec<f64>>,
    /// Per metric: rows with a sample it could score (the rows of pass@k
    /// and of the majority vote: a row it could score no sample of is in
    /// neither).
    judged_rows: Vec<u64>,
    majority_sums: Vec<f64>,
}

impl Samples {
    pub fn new(k: u32, metrics: &[Metric]) -> Self {
        let ks: Vec<u64> = [1u64, 5, 10, 20, 50, 100]
            .into_iter()
            .filter(|x| *x < u64::from(k))
            .chain([u64::from(k)])
            .collect();
        Self {
            k,
            metrics: metrics.to_vec(),
            pass_sums: vec![vec![0.0; ks.len()]; metrics.len()],
            judged_rows: vec![0; metrics.len()],
            ks,
            row: None,
            samples: Vec::new(),
            rows: 0,
            binary: vec![true; metrics.len()],
            majority_sums: vec![0.0; metrics.len()],
        }
    }

    /// Adds a sample of row `row` (samples of a row come one after another).
    pub fn add(&mut self, row: &str, judged: Vec<Option<f64>>, vote: Option<String>) {
        if self.row.as_deref() != Some(row) {
            self.close_row();
            self.row = Some(row.to_owned());
        }
        self.samples.push(Sample { judged, vote });
    }

    fn close_row(&mut self) {
        if self.samples.is_empty() {
            return;
        }
        let samples = std::mem::take(&mut self.samples);
        self.rows += 1;
        for (i, metric) in self.metrics.iter().enumerate() {
            let values: Vec<f64> = samples.iter().filter_map(|s| s.judged[i]).collect();
            if values.is_empty() {
                continue;
            }
            self.binary[i] &= values.iter().all(|v| *v == 0.0 || *v == 1.0);
            let n = values.len() as u64;
            let c = values.iter().filter(|v| **v == 1.0).count() as u64;
            for (sum, k) in self.pass_sums[i].iter_mut().zip(&self.ks) {
                *sum += stats::pass_at_k(n, c, (*k).min(n));
            }
            self.judged_rows[i] += 1;
            // Votes: (answer, count, the first such sample's value).
            let mut votes: Vec<(&str, usize, f64)> = Vec::new();
            for sample in &samples {
                let (Some(vote), Some(value)) = (sample.vote.as_deref(), sample.judged[i]) else {
                    continue;
                };
                match votes.iter_mut().find(|(v, _, _)| *v == vote) {
                    Some(entry) => entry.1 += 1,
                    None => votes.push((vote, 1, value)),
                }
            }
            let best = votes
                .iter()
                .fold(None::<&(&str, usize, f64)>, |best, v| match best {
                    Some(b) if b.1 >= v.1 => Some(b),
                    _ => Some(v),
                });
            self.majority_sums[i] += best.map_or_else(|| metric.missing(), |b| b.2);
        }
    }

    pub fn finish(mut self) -> SamplesSummary {
        self.close_row();
        let metrics =
            self.metrics
                .iter()
                .enumerate()
                .map(|(i, m)| MetricSamples {
                    metric: m.key.clone(),
                    pass_at: (self.binary[i] && m.higher_is_better && self.judged_rows[i] > 0)
                        .then(|| {
                            self.ks
                                .iter()
                                .zip(&self.pass_sums[i])
                                .map(|(k, sum)| (*k, sum / self.judged_rows[i] as f64))
                                .collect()
                        }),
                    majority: if self.judged_rows[i] == 0 {
                        f64::NAN
                    } else {
                        self.majority_sums[i] / self.judged_rows[i] as f64
                    },
                })
                .collect();
        SamplesSummary {
            n: self.k,
            rows: self.rows,
            metrics,
        }
    }
}
