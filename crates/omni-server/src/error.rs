//! [`ApiError`]: the one error type of the HTTP layer, rendered as OpenAI's error JSON
//! `{"error":{"message","type","param","code"}}`, plus the table from engine errors to statuses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::engine::EngineError;

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// The offending request field, if one.
    pub param: Option<String>,
    /// OpenAI's machine-readable code, if one (`model_not_found`, `invalid_api_key`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn bad_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 not tied to one field.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::with_status(StatusCode::BAD_REQUEST, message)
    }

    /// Any status with a message.
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 404 for a model the server does not serve.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 401 for a missing or wrong API key.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key; send `Authorization: Bearer <key>`.".into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 503 for a connection beyond the listener's bound
    /// ([`ConnectionLimits::limit_concurrency`](crate::ConnectionLimits::limit_concurrency)).
    pub fn too_many_connections(limit: usize) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!(
                "The server is at its limit of {limit} open connections; retry after one closes."
            ),
            param: None,
            code: Some("too_many_connections"),
        }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::with_status(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// OpenAI's `type` for the status.
    pub fn error_type(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.error_type(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let (status, code) = match &e {
            EngineError::Dead { .. } => (StatusCode::SERVICE_UNAVAILABLE, Some("engine_dead")),
            EngineError::Overloaded { .. } => {
                (StatusCode::TOO_MANY_REQUESTS, Some("rate_limit_exceeded"))
            }
            EngineError::InvalidRequest { .. } => (StatusCode::BAD_REQUEST, None),
            EngineError::Internal { .. } => (StatusCode::INTERNAL_SERVER_ERROR, None),
        };
        Self {
            status,
            message: e.to_string(),
            param: None,
            code,
        }
    }
}

impl From<omni_protocol::SamplingParamsError> for ApiError {
    fn from(e: omni_protocol::SamplingParamsError) -> Self {
        use omni_protocol::SamplingParamsError as E;
        let param = match &e {
            E::Temperature(_) => "temperature",
            E::TopP(_) => "top_p",
            E::MinP(_) => "min_p",
            E::Penalty { name, .. } => name,
            E::RepetitionPenalty(_) => "repetition_penalty",
            E::MaxTokens => "max_tokens",
            E::MinTokens { .. } => "min_tokens",
        };
        Self::bad_param(param, e.to_string())
    }
}

impl From<axum::extract::rejection::BytesRejection> for ApiError {
    fn from(e: axum::extract::rejection::BytesRejection) -> Self {
        let status = e.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "Request body is too large.".to_string()
        } else {
            e.body_text()
        };
        Self {
            status,
            message,
            param: None,
            code: (status == StatusCode::PAYLOAD_TOO_LARGE).then_some("request_too_large"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_openai_statuses() {
        let dead = ApiError::from(EngineError::Dead { cause: "x".into() });
        assert_eq!(dead.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(dead.error_type(), "server_error");
        let busy = ApiError::from(EngineError::Overloaded { reason: "x".into() });
        assert_eq!(busy.status, StatusCode::TOO_MANY_REQUESTS);
        let body = ApiError::model_not_found("m").body();
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["error"]["param"], "model");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}
