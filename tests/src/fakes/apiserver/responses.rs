//! The fake's HTTP answers: a body fed from a channel (so that a watch can
//! stream), a JSON answer, and a Kubernetes `Status` for failures.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use hyper::{
    Response, StatusCode,
    body::{Bytes, Frame},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ListMeta, Status};
use tokio::sync::mpsc;

/// A response body: chunks from a channel, ended when the sender is dropped.
pub(super) struct ChannelBody(pub(super) mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

pub(super) fn json_response(status: StatusCode, body: Vec<u8>) -> Response<ChannelBody> {
    let (tx, rx) = mpsc::channel(1);
    tx.try_send(Bytes::from(body)).unwrap();
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(ChannelBody(rx))
        .unwrap()
}

pub(super) fn status(code: u16, reason: &str, message: &str) -> Status {
    Status {
        code: Some(i32::from(code)),
        message: Some(message.to_owned()),
        reason: Some(reason.to_owned()),
        status: Some("Failure".to_owned()),
        metadata: ListMeta::default(),
        ..Status::default()
    }
}

pub(super) fn status_response(code: u16, reason: &str, message: &str) -> Response<ChannelBody> {
    let mut body = serde_json::to_value(status(code, reason, message)).unwrap();
    body["kind"] = "Status".into();
    body["apiVersion"] = "v1".into();
    json_response(StatusCode::from_u16(code).unwrap(), serde_json::to_vec(&body).unwrap())
}
