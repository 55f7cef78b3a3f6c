//! `[log]`: how quotad writes its log (stderr), and the optional request log.

use super::{Validator, raw};

/// One line per event: readable text, or one JSON object (for a log pipeline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct LogSettings {
    /// `log.format`; fixed for the life of the process (a reload that changes it is
    /// refused).
    pub(crate) format: LogFormat,
    /// `log.requests`: the share of requests written to the request log, 0 (off, the
    /// default) to 1 (every one); applies on reload.
    pub(crate) requests: f64,
}

impl Validator<'_> {
    pub(super) fn log(&mut self, raw: &raw::Log) -> LogSettings {
        let format = match raw.format.as_ref().map(|f| (f, f.get_ref().as_str())) {
            None | Some((_, "text")) => LogFormat::Text,
            Some((_, "json")) => LogFormat::Json,
            Some((f, _)) => {
                self.error(f, "log.format", "must be \"text\" or \"json\"");
                LogFormat::Text
            }
        };
        let requests = match raw.requests.as_ref() {
            None => 0.0,
            Some(r) if (0.0..=1.0).contains(r.get_ref()) => *r.get_ref(),
            Some(r) => {
                self.error(
                    r,
                    "log.requests",
                    "must be a share of requests from 0 (off) to 1 (every request)",
                );
                0.0
            }
        };
        LogSettings { format, requests }
    }
}

/// `requests` as "log every Nth request" (0: none): an even sample without a random
/// source on the request path.
pub(crate) fn sample_every(requests: f64) -> u64 {
    if requests <= 0.0 {
        0
    } else {
        (1.0 / requests).round().max(1.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_becomes_every_nth_request() {
        assert_eq!(sample_every(0.0), 0);
        assert_eq!(sample_every(1.0), 1);
        assert_eq!(sample_every(0.01), 100);
        assert_eq!(sample_every(0.3), 3);
    }
}
