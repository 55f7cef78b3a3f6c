//! Request bodies, read under a size cap, a deadline and a memory budget: a client that
//! declares or sends more than the cap gets 413 before more is buffered, one that stops
//! sending gets 408 after `server.body_timeout`, and broken framing (bad chunk sizes, a body
//! cut short) is a 400. Every body being read holds its share (its declared length, or the
//! cap) of `server.max_body_memory` until it is handled; when the budget is spent, 503
//! `overloaded` (shed, reason `body_memory`) at once. Only the bytes actually received are
//! allocated, never the declared length.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};
use futures_util::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;
use crate::metrics::Metrics;
use crate::store::Shed;

/// The budget, in KiB, that bodies being read share.
#[derive(Clone)]
pub(crate) struct BodyBudget {
    kib: Arc<Semaphore>,
    metrics: Arc<Metrics>,
}

impl BodyBudget {
    pub(crate) fn new(bytes: usize, metrics: Arc<Metrics>) -> Self {
        metrics.shed.with_label_values(&[Shed::BodyMemory.reason()]);
        BodyBudget {
            kib: Arc::new(Semaphore::new(bytes.div_ceil(1024).max(1))),
            metrics,
        }
    }

    /// Room for a body of up to `bytes`, or shed at once.
    pub(crate) fn take(&self, bytes: u64) -> Result<OwnedSemaphorePermit, ApiError> {
        let kib = (bytes.div_ceil(1024).max(1)).min(u32::MAX as u64) as u32;
        self.kib.clone().try_acquire_many_owned(kib).map_err(|_| {
            self.metrics
                .shed
                .with_label_values(&[Shed::BodyMemory.reason()])
                .inc();
            ApiError::Overloaded(Shed::BodyMemory)
        })
    }
}

/// The body's declared length, if any.
pub(crate) fn declared(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Reads `body` whole; `max` bytes at most, within `timeout`, holding its share of
/// `budget` (if any: the peer endpoint has per-peer budgets of its own) until the returned
/// permit is dropped.
pub(crate) async fn read(
    headers: &HeaderMap,
    body: Body,
    max: usize,
    timeout: Duration,
    budget: Option<&BodyBudget>,
) -> Result<(Bytes, Option<OwnedSemaphorePermit>), ApiError> {
    let declared = declared(headers);
    if declared.is_some_and(|n| n > max as u64) {
        return Err(ApiError::PayloadTooLarge { max });
    }
    let room = match budget {
        Some(b) => Some(b.take(declared.unwrap_or(max as u64))?),
        None => None,
    };
    let collect = async {
        let mut stream = body.into_data_stream();
        // Grown as bytes arrive: a declared length is a claim, not a reason to allocate.
        let mut buf = Vec::with_capacity(declared.unwrap_or(0).min(4096) as usize);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ApiError::InvalidBody(e.to_string()))?;
            if buf.len() + chunk.len() > max {
                return Err(ApiError::PayloadTooLarge { max });
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    let bytes = tokio::time::timeout(timeout, collect)
        .await
        .map_err(|_| ApiError::BodyTimeout(timeout))??;
    Ok((bytes, room))
}
