//! The Lease as the API holds it (`coordination.k8s.io/v1`, through
//! kube-rs): read, created, claimed and released, every write over the
//! resourceVersion read (a stale one gets `409 Conflict`).

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{Api, Client, api::PostParams};

use super::machine::Record;
use crate::{config::LeaseRef, discovery::chain};

/// Why a write did not happen.
#[derive(Debug)]
pub(crate) enum WriteError {
    /// The Lease changed since it was read, already exists, or is gone:
    /// read it again.
    Conflict,
    /// Anything else (the API unreachable, refused, a timeout).
    Failed(String),
}

/// One Lease and the last version of it read or written (writes start
/// from it).
pub(crate) struct LeaseApi {
    api: Api<Lease>,
    lease: LeaseRef,
    last: Option<Lease>,
    /// Each request's limit.
    timeout: Duration,
}

impl LeaseApi {
    pub(crate) fn new(client: Client, lease: LeaseRef, timeout: Duration) -> Self {
        Self { api: Api::namespaced(client, &lease.namespace), lease, last: None, timeout }
    }

    /// Reads the Lease (`None`: there is none).
    pub(crate) async fn read(&mut self) -> Result<Option<Record>, String> {
        let got = tokio::time::timeout(self.timeout, self.api.get_opt(&self.lease.name))
            .await
            .map_err(|_| {
                format!("reading Lease {}: no answer within {:?}", self.lease, self.timeout)
            })?
            .map_err(|e| format!("reading Lease {}: {}", self.lease, chain(&e)))?;
        self.last.clone_from(&got);
        Ok(got.as_ref().map(record_of))
    }

    /// Creates the Lease, held by `me` for `duration`.
    pub(crate) async fn create(
        &mut self,
        me: &str,
        duration: Duration,
    ) -> Result<Record, WriteError> {
        let now = MicroTime(Timestamp::now());
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.lease.name.clone()),
                namespace: Some(self.lease.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(me.to_owned()),
                lease_duration_seconds: Some(seconds(duration)),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        let (api, post) = (self.api.clone(), PostParams::default());
        let created = self.write(api.create(&post, &lease)).await?;
        Ok(record_of(&created))
    }

    /// Writes `me` as the holder (a takeover, or a renewal when it holds
    /// already) over the version last read.
    pub(crate) async fn claim(
        &mut self,
        me: &str,
        duration: Duration,
    ) -> Result<Record, WriteError> {
        let mut lease = self.last.clone().ok_or(WriteError::Conflict)?;
        let spec = lease.spec.get_or_insert_default();
        let now = MicroTime(Timestamp::now());
        if spec.holder_identity.as_deref() != Some(me) {
            spec.holder_identity = Some(me.to_owned());
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.lease_duration_seconds = Some(seconds(duration));
        spec.renew_time = Some(now);
        let (api, post, name) = (self.api.clone(), PostParams::default(), self.lease.name.clone());
        let written = self.write(api.replace(&name, &post, &lease)).await?;
        Ok(record_of(&written))
    }

    /// Writes the Lease released (no holder), so that another node takes
    /// it at once rather than when it runs out.
    pub(crate) async fn release(&mut self) -> Result<Record, WriteError> {
        let mut lease = self.last.clone().ok_or(WriteError::Conflict)?;
        let spec = lease.spec.get_or_insert_default();
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        let (api, post, name) = (self.api.clone(), PostParams::default(), self.lease.name.clone());
        let written = self.write(api.replace(&name, &post, &lease)).await?;
        Ok(record_of(&written))
    }

    /// Sends `request` within the timeout; what the API wrote
    /// is the base of the next write.
    async fn write(
        &mut self,
        request: impl Future<Output = Result<Lease, kube::Error>>,
    ) -> Result<Lease, WriteError> {
        match tokio::time::timeout(self.timeout, request).await {
            Err(_) => Err(WriteError::Failed(format!(
                "writing Lease {}: no answer within {:?}",
                self.lease, self.timeout
            ))),
            Ok(Ok(written)) => {
                self.last = Some(written.clone());
                Ok(written)
            }
            Ok(Err(kube::Error::Api(status))) if matches!(status.code, 404 | 409) => {
                self.last = None;
                Err(WriteError::Conflict)
            }
            Ok(Err(e)) => {
                Err(WriteError::Failed(format!("writing Lease {}: {}", self.lease, chain(&e))))
            }
        }
    }
}

/// What the machine decides by, of a Lease.
fn record_of(lease: &Lease) -> Record {
    let spec = lease.spec.as_ref();
    Record {
        holder: spec.and_then(|s| s.holder_identity.clone()).filter(|h| !h.is_empty()),
        duration: Duration::from_secs(
            spec.and_then(|s| s.lease_duration_seconds)
                .map_or(0, |d| u64::try_from(d).unwrap_or(0)),
        ),
        version: lease.metadata.resource_version.clone().unwrap_or_default(),
    }
}

fn seconds(duration: Duration) -> i32 {
    i32::try_from(duration.as_secs()).unwrap_or(i32::MAX).max(1)
}
