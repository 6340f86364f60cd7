from hybridserve.core.connector.base import KVConnectorBase

__all__ = ["KVConnectorBase"]
