//! What rank 0 sends the other ranks, one frame per command.

use crate::Error;
use crate::batch::{self, Sample};

/// What rank 0 tells the others to do next.
pub(super) enum Command {
    /// Train on these samples at this learning rate (every rank alike).
    Step {
        samples: Vec<Sample>,
        lr: f64,
    },
    Checkpoint(u64),
    Stop,
}

impl Command {
    pub(super) fn encode(&self) -> Vec<u8> {
        match self {
            Command::Step { samples, lr } => [vec![0], lr.to_le_bytes().to_vec(), batch::encode(samples)].concat(),
            Command::Checkpoint(step) => [vec![1], step.to_le_bytes().to_vec()].concat(),
            Command::Stop => vec![2],
        }
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Self, Error> {
        match bytes.split_first() {
            Some((0, rest)) if rest.len() >= 8 => {
                let (lr, samples) = rest.split_at(8);
                let lr = f64::from_le_bytes(lr.try_into().expect("8 bytes"));
                batch::decode(samples).map(|samples| Command::Step { samples, lr }).map_err(Error::Train)
            }
            Some((1, rest)) if rest.len() == 8 => {
                Ok(Command::Checkpoint(u64::from_le_bytes(rest.try_into().expect("8 bytes"))))
            }
            Some((2, _)) => Ok(Command::Stop),
            _ => Err(Error::Train("malformed command from rank 0".into())),
        }
    }
}
