//! f32 rows as out-of-band message buffers: what stage payloads carry.

use omni_protocol::{DType, RequestId, TensorRef};

use crate::StageError;

/// Buffers of one outgoing message, appended in order.
#[derive(Debug, Default)]
pub(crate) struct Buffers(pub(crate) Vec<Vec<u8>>);

impl Buffers {
    /// Appends `rows x width` f32 values as a buffer and names it.
    pub(crate) fn push_f32(
        &mut self,
        name: &str,
        request_id: &RequestId,
        data: &[f32],
        width: usize,
    ) -> TensorRef {
        let rows = data.len().checked_div(width).unwrap_or(0);
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.0.push(bytes);
        TensorRef {
            name: name.to_string(),
            request_id: Some(request_id.clone()),
            dtype: DType::F32,
            shape: vec![rows as u64, width as u64],
            buffer_index: (self.0.len() - 1) as u32,
        }
    }
}

/// The f32 values of `t` in `buffers`, checked against its shape.
pub(crate) fn read_f32(t: &TensorRef, buffers: &[&[u8]]) -> Result<Vec<f32>, StageError> {
    if t.dtype != DType::F32 {
        return Err(StageError::Input(format!(
            "tensor {} is {:?}, expected f32",
            t.name, t.dtype
        )));
    }
    let Some(b) = buffers.get(t.buffer_index as usize) else {
        return Err(StageError::Input(format!(
            "tensor {} names buffer {} of {}",
            t.name,
            t.buffer_index,
            buffers.len()
        )));
    };
    let n: u64 = t.shape.iter().product();
    if b.len() as u64 != n * 4 {
        return Err(StageError::Input(format!(
            "tensor {} of shape {:?} has {} bytes",
            t.name,
            t.shape,
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_and_a_short_buffer_is_refused() {
        let mut b = Buffers::default();
        let id: RequestId = "r".into();
        let t = b.push_f32("x", &id, &[1.0, -2.5, 3.0, 4.0], 2);
        assert_eq!(t.shape, vec![2, 2]);
        let views: Vec<&[u8]> = b.0.iter().map(Vec::as_slice).collect();
        assert_eq!(read_f32(&t, &views).unwrap(), vec![1.0, -2.5, 3.0, 4.0]);
        let short: Vec<&[u8]> = vec![&b.0[0][..8]];
        assert!(read_f32(&t, &short).is_err());
    }
}
