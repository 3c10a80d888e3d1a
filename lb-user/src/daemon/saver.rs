//! The state file, written off the owner loop: a write ends with two
//! fsyncs (the file, then its directory), which on a busy disk take long
//! enough to delay kernel reports behind them. One thread writes; a burst
//! of saves is one write of the latest state.

use std::{path::PathBuf, sync::mpsc};

use tracing::error;

use crate::state::SavedState;

/// Told how a save went: `Ok`, or the error for a person.
pub(super) type Done = Box<dyn FnOnce(Result<(), String>) + Send>;

/// One save: the state to write and who waits for it, if anyone.
struct Save {
    state: SavedState,
    done: Option<Done>,
}

/// The owner loop's handle on the writing thread. Dropping it waits for
/// the saves already asked for: a daemon that exits has written its last
/// state.
pub(super) struct Saver {
    saves: Option<mpsc::Sender<Save>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Saver {
    /// Starts the thread that writes the state file into `dir`.
    pub(super) fn start(dir: PathBuf) -> anyhow::Result<Self> {
        let (saves, queue) = mpsc::channel::<Save>();
        let thread = std::thread::Builder::new().name("lb-saver".into()).spawn(move || {
            // Ends when the owner loop's handle is dropped, after the
            // saves already asked for.
            while let Ok(first) = queue.recv() {
                let mut latest = first.state;
                let mut waiting: Vec<Done> = first.done.into_iter().collect();
                for later in queue.try_iter() {
                    latest = later.state;
                    waiting.extend(later.done);
                }
                let result = latest.save(&dir).map_err(|e| format!("{e:#}"));
                if let Err(e) = &result {
                    error!("saving the server lists to the state directory failed: {e}");
                }
                for done in waiting {
                    done(result.clone());
                }
            }
        })?;
        Ok(Self { saves: Some(saves), thread: Some(thread) })
    }

    /// Writes `state` soon; `done`, if given, is told how it went (on the
    /// writing thread).
    pub(super) fn save(&self, state: SavedState, done: Option<Done>) {
        let save = Save { state, done };
        let unsent = match &self.saves {
            Some(saves) => saves.send(save).err().map(|mpsc::SendError(save)| save),
            None => Some(save),
        };
        if let Some(Save { done: Some(done), .. }) = unsent {
            done(Err("the state file's writer is gone".to_owned()));
        }
    }
}

impl Drop for Saver {
    fn drop(&mut self) {
        drop(self.saves.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        net::SocketAddr,
        sync::{Arc, Mutex},
    };

    use super::*;
    use crate::state::SavedList;

    fn state(port: u16) -> SavedState {
        let mut state = SavedState::default();
        let server = SocketAddr::from(([127, 0, 0, 1], port));
        state.services.insert(
            "api".to_owned(),
            SavedList {
                servers: vec![server],
                default: None,
                configured: vec![server],
                configured_default: None,
                drained: Vec::new(),
                discovered_at: None,
            },
        );
        state
    }

    /// Every save asked for is answered, and the file ends with the last
    /// state however the saves were batched; dropping the saver waits for
    /// them.
    #[test]
    fn saves_end_with_the_last_state_and_each_is_answered() {
        let dir = std::env::temp_dir().join(format!("lb-saver-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let answered = Arc::new(Mutex::new(Vec::new()));
        let saver = Saver::start(dir.clone()).unwrap();
        for port in 1..=50 {
            let answered = Arc::clone(&answered);
            let done: Done = Box::new(move |result| answered.lock().unwrap().push(result));
            saver.save(state(port), (port % 10 == 0).then_some(done));
        }
        drop(saver);
        let answers = answered.lock().unwrap().clone();
        assert_eq!(answers, vec![Ok(()); 5]);
        let written = SavedState::load(&dir);
        assert_eq!(written, state(50));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
