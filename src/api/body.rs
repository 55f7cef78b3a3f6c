//! Request bodies, read under a size cap and a deadline: a client that declares or sends
//! more than the cap gets 413 before more is buffered, one that stops sending gets 408
//! after `server.body_timeout`, and broken framing (bad chunk sizes, a body cut short) is
//! a 400. Only the bytes actually received are held, never the declared length.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};
use futures_util::StreamExt;

use super::error::ApiError;

/// Reads `body` whole; `max` bytes at most, within `timeout`.
pub async fn read(
    headers: &HeaderMap,
    body: Body,
    max: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(ApiError::PayloadTooLarge { max });
    }
    let collect = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(declared.unwrap_or(0).min(max as u64) as usize);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ApiError::InvalidBody(e.to_string()))?;
            if buf.len() + chunk.len() > max {
                return Err(ApiError::PayloadTooLarge { max });
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    tokio::time::timeout(timeout, collect)
        .await
        .map_err(|_| ApiError::BodyTimeout(timeout))?
}
